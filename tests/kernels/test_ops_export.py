"""A torch.export'ed patched model runs in a fresh process that imported only ``approxbp.kernels``: the custom ops
carry a key any process can resolve (ops/modules.py: spec_key, spec_of), not an index into this process's memory."""

import json
import subprocess
import sys

import pytest
import torch
from _helpers import exported
from approxbp.approximations import tables as table_files
from approxbp.kernels import (
    InvActSiLU,
    MSLayerNorm,
    ReGELU2,
    ReLUSumActivation,
)
from approxbp.kernels.ops.modules import SPECS, spec_of

LOAD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[3]))  # the parent's: CPU reductions round by how they are split over threads
import approxbp.kernels  # registers the ops; builds no drop-in
ep = torch.export.load(sys.argv[1])
x = torch.load(sys.argv[2]).requires_grad_(True)
ep.module()(x).square().sum().backward()
print(json.dumps(x.grad.flatten().tolist()))
"""


def assert_same_gradients_in_a_fresh_process(model, x, tmp_path):
    """torch.export the model, save it, load and run it where only approxbp.kernels was imported (LOAD), with this
    process's thread count (the claim is the same program on the same inputs under the same settings): the input
    gradient must equal this process's bit for bit."""
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "model.pt2")
    torch.save(x, tmp_path / "x.pt")
    xi = x.clone().requires_grad_(True)
    model(xi).square().sum().backward()
    r = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "model.pt2"), str(tmp_path / "x.pt"),
                        str(torch.get_num_threads())],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1]) == xi.grad.flatten().tolist()


@pytest.mark.slow
def test_an_exported_program_runs_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), ReGELU2(), torch.nn.Linear(6, 6), InvActSiLU(),
                                torch.nn.Linear(6, 2))
    assert_same_gradients_in_a_fresh_process(model, torch.randn(5, 6), tmp_path)


@pytest.mark.slow
def test_an_exported_patched_block_runs_in_a_fresh_process(tmp_path):
    """a patch_model'ed block (LayerNorms merged, GELU swapped for InvAct), exported
    and saved, gives the same gradients in a process that imported only approxbp.kernels."""
    from approxbp.kernels import patch_model

    from approxbp.blocks import GPTBlock

    torch.manual_seed(0)
    block = GPTBlock(d=16, hidden=32, heads=2, causal=True)
    x = torch.randn(2, 5, 16)
    report = patch_model(block, family="invact", example_input=x)
    assert report.activations and report.norms
    assert_same_gradients_in_a_fresh_process(block, x, tmp_path)


def test_a_key_rebuilds_its_spec_and_refuses_a_changed_table(tmp_path):

    path = exported(table_files.load("relu_sum/silu-k2-derivative") | {"activation": "mine"}, tmp_path / "t.json")
    key = ReLUSumActivation(path).spec.key
    assert key.startswith("relu-sum:") and str(path.resolve()) in key
    del SPECS[key]
    assert spec_of(key).table.sha256 == table_files.load(path).sha256  # rebuilt from the key alone
    del SPECS[key]
    # the table changed since the program was made
    table_files.save(table_files.load(path) | {"activation": "mine, renamed"}, path)
    with pytest.raises(RuntimeError, match="generated from another version"):  # its kernels too
        spec_of(key)
    exported(table_files.load(path), path)
    with pytest.raises(RuntimeError, match="export the program again"):
        spec_of(key)



@pytest.mark.slow
def test_an_at_sign_or_percent_in_the_table_or_kernels_folder_survives_the_key(tmp_path):
    """spec_of split keys at '@', so a table folder named like 'runs@v2' broke torch.export'ed programs."""
    folder, kernels = tmp_path / "runs@v2 %40", tmp_path / "k@ernels"
    folder.mkdir()
    path = exported(table_files.load("relu_sum/silu-k2-derivative") | {"activation": "mine"}, folder / "t.json",
                    kernels)
    module = ReLUSumActivation(path, kernels_dir=kernels)
    key = module.spec.key
    del SPECS[key]
    again = spec_of(key)
    assert again.path == path.resolve() and again.kernels_dir == str(kernels.resolve())
    assert_same_gradients_in_a_fresh_process(torch.nn.Sequential(torch.nn.Linear(4, 4), module), torch.randn(3, 4),
                                             tmp_path)

# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----


@pytest.mark.parametrize("make", [ReGELU2, InvActSiLU, lambda: MSLayerNorm(4)])
def test_torch_export_keeps_our_backward(make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), make(), torch.nn.Linear(4, 3))
    x = torch.randn(5, 4)
    ep = torch.export.export(model, (x,))
    assert any(str(n.target).startswith("approxbp.") for n in ep.graph.nodes), "our op is kept, not decomposed"
    grads = []
    for m in (model, ep.module()):
        xi = x.clone().requires_grad_(True)
        m(xi).square().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
    if make is ReGELU2:  # and it is the approximation's gradient, not exact GELU's
        ref = torch.nn.Sequential(model[0], torch.nn.GELU(), model[2])
        xi = x.clone().requires_grad_(True)
        ref(xi).square().sum().backward()
        assert not torch.allclose(xi.grad, grads[0])
