"""``approxbp cost``: kernels compiled offline for sm_90 and their SASS counted (a subprocess without
TRITON_INTERPRET, which would replace the kernels), and every family compiles in every dtype. One ``approxbp cost``
run measures every table the tests give it and one Python process does every compile-only check (module fixtures):
each start of torch and Triton costs seconds."""

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
PACKAGED = ("relu_sum/gelu-k2-primitive.json", "relu_sum/silu-k6-derivative.json", "invact/gelu-fast.json")


@pytest.fixture(scope="module")
def cost_cli(tmp_path_factory):
    """``approxbp cost`` on three packaged tables, a user's copy of a table (``mine-k2-primitive.json``, its module
    generated next to it) and a fitted SERF table (k = 1, an activation without a reference pair)."""
    from approxbp.approximations import tables as table_files

    from approxbp.cli import main

    d = tmp_path_factory.mktemp("cost")
    (d / "mine").mkdir()
    mine, serf, out = d / "mine" / "mine-k2-primitive.json", d / "serf.json", d / "cost.json"
    shutil.copy(table_files.resolve("silu-k2-primitive", "relu-sum"), mine)
    assert main(["fit", "relu-sum", "--activation", "x*erf(log(1+exp(x)))", "--name", "serf", "--bits", "1",
                 "--restarts", "1", "--workers", "1", "--no-progress", "--out", str(serf)]) == 0
    r = subprocess.run([sys.executable, "-m", "approxbp", "cost", *PACKAGED, str(mine), str(serf), "--json", str(out),
                        "--no-progress"], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return SimpleNamespace(dir=d, stdout=r.stdout, rows={k["name"]: k for k in json.loads(out.read_text())["kernels"]})


COMPILE_CHECKS = """
    import json, sys
    from pathlib import Path
    from approxbp import cost
    from approxbp.approximations import tables as table_files
    from approxbp.kernels.codegen import export
    tmp = Path(sys.argv[1])
    results = {}

    done = []  # every family in every dtype
    for dtype in ("bf16", "fp16", "fp32", "fp64"):
        dt = cost.DTYPES[dtype]
        todo = (cost.relu_sum_launches(table_files.resolve("gelu_tanh-k3-derivative", "relu-sum"), dt)
                + cost.relu_sum_launches(table_files.resolve("mish-k5-primitive", "relu-sum"), dt)
                + cost.invact_launches(table_files.resolve("silu-fast", "invact"), dt)
                + cost.norm_launches(dt, 768) + cost.bdia_launches(dt))
        for name, launch, n in todo:
            cost.compile_sm90(launch)
            done.append(f"{dtype} {name}")
    results["families"] = len(done)

    t = json.loads(table_files.resolve("silu-k2-primitive", "relu-sum").read_text())  # a user's expressions
    out = []
    for i, expr in enumerate(["x*sigmoid(x + sin(x)/1000)", "x*sigmoid(x*cosh(x/100) + sinh(x/100))",
                              "x*(1 - erfc(x)/2)*cos(x/1000)"]):
        t.update(activation=expr, expression=expr)
        p = tmp / f"user{i}-k2-primitive.json"
        p.write_text(json.dumps(t))
        export([p])
        for name, launch, n in cost.relu_sum_launches(p, cost.DTYPES["bf16"]):
            cost.compile_sm90(launch)
            out.append(name)
    results["user"] = len(out)

    mufu = {}  # the float32 primitives' MUFU instructions
    for table, family, dtype in (("gelu-fast", "invact", "bf16"), ("gelu-k2-derivative", "relu-sum", "bf16"),
                                 ("gelu-fast", "invact", "fp64")):
        launches = (cost.invact_launches if family == "invact" else cost.relu_sum_launches)(
            table_files.resolve(table, family), cost.DTYPES[dtype])
        for name, launch, n in launches:
            kernel, _ = cost.compile_sm90(launch)
            sass, _ = cost.disassemble(kernel.asm["cubin"])
            ptx = kernel.asm["ptx"]
            mufu[f"{name} {dtype}"] = (sorted(set(op for _, op, _ in sass if op.startswith("MUFU"))),
                                       "div.full" in ptx, "div.rn" in ptx or "div.rnd" in ptx)
    results["mufu"] = mufu
    print(repr(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compile-only checks, one process without TRITON_INTERPRET: a dict of what each part found."""
    d = tmp_path_factory.mktemp("compiled")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(COMPILE_CHECKS), str(d)], env=ENV, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cost_compiles_one_kernel_of_each_family_and_counts_them(cost_cli):
    rows = {name: k for name, k in cost_cli.rows.items() if not name.startswith(("silu-k2", "serf", "exact serf"))}
    assert set(rows) == {"gelu-k2-primitive fwd", "gelu-k2-primitive bwd", "silu-k6-derivative fwd",
                         "silu-k6-derivative bwd", "invact gelu-fast fwd", "invact gelu-fast bwd"}
    for k in rows.values():  # measured from the SASS of this run: plausible, not stored numbers
        assert 5 < k["instructions_per_element"] < 400 and k["registers"] > 0 and k["spill_instructions"] == 0
        assert k["ratio"] == pytest.approx(k["instructions_per_element"] / (10.4530 * k["bytes_per_element"]),
                                           abs=2e-3)
    # bytes per element: 2 in, 2 out and the codes (2 bits) for a k = 2 bf16 forward
    assert rows["gelu-k2-primitive fwd"]["bytes_per_element"] == pytest.approx(4.25, abs=1e-3)
    assert rows["gelu-k2-primitive fwd"]["mufu_per_element"] >= 1  # erf's exp
    # 128-bit loads and stores of the activation, rows of 8 two-bit codes written at least 16 bits wide
    w = rows["gelu-k2-primitive fwd"]["widths"]
    assert w["x_ptr"] == "ld128" and w["y_ptr"] == "st128" and int(w["packed_ptr"][2:]) >= 16
    assert "gelu-k2-primitive fwd" in cost_cli.stdout and "ratio" in cost_cli.stdout


def test_cost_refuses_the_interpreter(monkeypatch, capsys):
    from approxbp.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["cost", "relu_sum/gelu-k1-primitive.json"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.slow
def test_every_family_compiles_for_sm90_in_every_dtype(compiled):
    """The interpreter alone misses printer gaps and dtype errors that only the compiler sees."""
    assert compiled["families"] == 4 * 12


@pytest.mark.slow
def test_a_user_expression_exports_and_compiles_or_is_refused(compiled):
    """sin, cos, sinh, cosh and erfc lower to Triton; atan has no Triton form and export says so."""
    from approxbp.approximations import get_activation
    from approxbp.kernels.codegen import triton_source

    assert "tl.sin" in triton_source(get_activation("x*sigmoid(x + sin(x)/1000)").expr)
    with pytest.raises(ValueError, match="cannot lower atan to Triton"):
        triton_source(get_activation("x*sigmoid(atan(x))").expr)
    assert compiled["user"] == 6


@pytest.mark.slow
def test_cost_of_a_users_new_table_before_training(cost_cli):
    """A researcher who fits a new form sees its GPU cost: the module is generated next to the table first."""
    assert (cost_cli.dir / "mine" / "_generated").is_dir() and "silu-k2-primitive fwd" in cost_cli.stdout


@pytest.mark.slow
def test_compiled_float32_primitives_are_single_mufu_instructions(compiled):
    """Compiled (not interpreted), the helpers print one MUFU each: _rcp → RCP (no div.full), _log → LG2 (no
    libdevice logf), the 16-bit Φ → RCP and EX2 (no erf); fp64 keeps the exact operations."""
    got = compiled["mufu"]
    assert got["invact gelu-fast bwd bf16"][0] == ["MUFU.LG2", "MUFU.RCP", "MUFU.SQRT"], got
    assert not got["invact gelu-fast bwd bf16"][1]
    assert got["gelu-k2-derivative fwd bf16"][0] == ["MUFU.EX2", "MUFU.RCP"], got  # the 16-bit Φ, no erf
    assert not any(op in ("MUFU.RCP", "MUFU.LG2") for op in got["invact gelu-fast bwd fp64"][0])


@pytest.mark.slow
def test_a_new_activation_gets_its_plain_exact_kernels_as_the_baseline(cost_cli):
    """A user's table (SERF, k = 1): cost prints the exact activation's own one-line kernels beside the table's."""
    rows = cost_cli.rows
    assert {"exact serf fwd (plain)", "exact serf bwd (plain)"} <= set(rows)
    assert rows["exact serf fwd (plain)"]["bytes_per_element"] == pytest.approx(4.0)  # x in, y out, nothing kept
    assert rows["exact serf bwd (plain)"]["bytes_per_element"] == pytest.approx(6.0)  # g, x in; dx out


def test_the_plain_exact_kernels_compute_the_activation_and_its_derivative(tmp_path):
    """Run under TRITON_INTERPRET against the float64 expression."""
    import importlib.util

    import torch
    from approxbp.approximations import get_activation
    from approxbp.kernels.codegen import render_reference

    act = get_activation("x*erf(log(1+exp(x)))")
    path = tmp_path / "ref.py"
    path.write_text(render_reference(act))
    spec = importlib.util.spec_from_file_location("serf_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.linspace(-12, 12, 5000)
    g = torch.randn(5000)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    grid = (2,)
    module.forward_kernel[grid](x, y, 5000, BLOCK=module.BLOCK)
    module.backward_kernel[grid](g, x, dx, 5000, BLOCK=module.BLOCK)
    xd = x.double().numpy()
    assert torch.allclose(y.double(), torch.from_numpy(act.f(xd)), rtol=1e-5, atol=1e-6)
    assert torch.allclose(dx.double(), g.double() * torch.from_numpy(act.df(xd)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_the_packaged_baselines_are_generated_and_compute_torchs_activation(act):
    """Issue 70: the torch-like GELU and SiLU baselines of `approxbp cost` are generated like every kernel (no
    hand-written formula); committed as rendered, and under TRITON_INTERPRET they compute torch's activation and its
    derivative in float32."""
    import importlib

    import torch
    from approxbp.approximations import get_activation
    from approxbp.kernels.codegen import REFERENCE_ACTIVATIONS, reference_module_path, render_reference

    assert act in REFERENCE_ACTIVATIONS
    assert reference_module_path(act).read_text() == render_reference(get_activation(act)), "run `approxbp export`"
    module = importlib.import_module(f"approxbp.kernels.generated.reference_{act}")
    x = torch.linspace(-8, 8, 5001)
    g = torch.randn(5001, generator=torch.Generator().manual_seed(0))
    y, dx = torch.empty_like(x), torch.empty_like(x)
    module.forward_kernel[(2,)](x, y, 5001, BLOCK=module.BLOCK)
    module.backward_kernel[(2,)](g, x, dx, 5001, BLOCK=module.BLOCK)
    xr = x.double().requires_grad_()
    want = getattr(torch.nn.functional, act)(xr)
    want.backward(g.double())
    torch.testing.assert_close(y.double(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.double(), xr.grad, rtol=1e-5, atol=1e-6)
