"""The kernels' run time is apart from the build side. Importing approxbp.kernels, building every public
drop-in, patching a model and running forward and backward (twin and Triton paths) imports neither sympy nor the code
generator and writes no file (tests/kernels/runtime_probe.py, in a fresh process, with an audit hook on writes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("runtime_probe.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path_factory.mktemp("run"))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_drop_in_ran_both_paths(report):
    assert len(report["ran"]) == 19 and "patch_model" in report["ran"]
    assert {r.split()[1] for r in report["ran"][:-1]} == {"use_triton=False", "use_triton=True"}


def test_run_time_imports_neither_sympy_nor_the_code_generator(report):
    assert report["sympy"] == [] and report["codegen"] == []
    assert "approxbp.fitting" not in report["approxbp_at_import"]


def test_run_time_writes_no_file(report):
    assert report["hook_sees_writes"], "the audit hook must see the probe's control write"
    assert report["writes"] == []


def test_the_build_side_does_import_sympy():
    """The check above can fail: the code generator imports sympy."""
    code = "import sys, approxbp.kernels as K; K.export; print('sympy' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "True", r.stderr


def test_a_spec_is_shared_by_copies_and_pickles_as_its_table():
    """Specs are immutable and hold a module object: a deep copy (patch_model copies models) is the spec itself, and
    a pickle (torch.save of a whole model) rebuilds it from the table path and kernels folder."""
    import copy
    import pickle

    from approxbp.kernels import InvActGELU, ReGELU2

    for module in (ReGELU2(), InvActGELU()):
        spec = module.spec
        assert copy.deepcopy(spec) is spec
        again = pickle.loads(pickle.dumps(spec))
        assert again.key == spec.key and again.module is spec.module
        assert type(pickle.loads(pickle.dumps(module))).__name__ == type(module).__name__


def test_a_pickle_refuses_a_table_file_that_changed_since(tmp_path):
    """A pickled drop-in loaded whatever its table file held at load time: saved with a silu k = 2 table, the file
    overwritten by a k = 4 table and re-exported, torch.load gave 4 bits per element without a word."""
    import pickle

    from _helpers import exported
    from approxbp.approximations import tables as table_files
    from approxbp.kernels import ReLUSumActivation

    path = exported(table_files.load("relu_sum/silu-k2-primitive") | {"activation": "mine"}, tmp_path / "t.json")
    saved = pickle.dumps(ReLUSumActivation(str(path)))
    assert pickle.loads(saved).spec.bits == 2  # unchanged: loads
    exported(table_files.load("relu_sum/silu-k4-primitive") | {"activation": "mine"}, path)
    with pytest.raises(RuntimeError, match="was saved with .*another table"):
        pickle.loads(saved)


def test_a_packaged_name_never_resolves_to_the_working_directory(tmp_path, monkeypatch):
    """A folder relu_sum/ with a table and a crafted _generated/ module in the working directory ran on
    patch_model(m, bits=3); packaged names resolve to the package, and a user's module runs only after its
    TABLE_SHA256 is read from its text and matches."""
    from approxbp.approximations import tables as table_files
    from approxbp.kernels import ReLUSumActivation
    from approxbp.kernels.ops.modules import kernel_dir, module_path

    name = "relu_sum/gelu-k3-primitive"
    local = tmp_path / f"{name}.json"
    local.parent.mkdir()
    local.write_text(table_files.resolve(name).read_text())
    marker = tmp_path / "ran"
    crafted = module_path(local, "relu-sum")
    crafted.parent.mkdir()
    crafted.write_text(f"open({str(marker)!r}, 'w').write('x')\nTABLE_SHA256 = 'no'\n")
    monkeypatch.chdir(tmp_path)
    assert table_files.resolve(name) == table_files.data_dir() / f"{name}.json" and kernel_dir(name) != crafted.parent
    assert ReLUSumActivation(name).spec.path == table_files.data_dir() / f"{name}.json"
    with pytest.raises(RuntimeError, match="read without running it"):
        ReLUSumActivation(f"./{name}.json")  # the local file, asked for explicitly: its module is refused unread
    assert not marker.exists()
