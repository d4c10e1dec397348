"""Issue 13: untrusted tables and expressions, atomic writes, reproducible bytes, no silent wrong answers.

Each test here failed on the main branch before the fix (payloads ran code, files were half-written, gradients
were 0 or 1 where they should be 1 or NaN, …)."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from approxbp.approximations import tables as T
from approxbp.approximations.expressions import ExpressionError
from approxbp.approximations.files import check_writable, write_atomic
from approxbp.kernels import (
    InvActGELU,
    InvActivation,
    InvActSiLU,
    MSLayerNorm,
    MSRMSNorm,
    ReGELU2,
    ReLUSumActivation,
    ReSiLU2,
    patch_model,
)
from approxbp.kernels.codegen import render
from hypothesis import given, settings
from hypothesis import strategies as st

MARKER = "approxbp-pwned-marker"


def _table(name: str) -> dict:
    return json.loads(T.resolve(name).read_text())


def _write(tmp_path: Path, t: dict, name: str = "t.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(t))
    return p


# ---- 1. expressions are parsed, never evaluated ----------------------------------------------------------
PAYLOADS = [
    f"__import__('os').system('touch {MARKER}') + y",
    "y.__class__.__mro__[1].__subclasses__()",
    "(lambda: y)()",
    "'abc' + y",
    "[y][0]",
    "y if y else y",
    "y.real",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_invact_branch_payload_is_refused_without_running(tmp_path, monkeypatch, payload):
    monkeypatch.chdir(tmp_path)
    t = _table("invact/gelu-paper")
    t["left"]["expression"] = payload
    p = _write(tmp_path, t)
    with pytest.raises(T.TableError, match="left.expression"):
        T.load(p)
    with pytest.raises(T.TableError):
        InvActivation(str(p))
    r = subprocess.run([sys.executable, "-m", "approxbp.cli", "export", str(p), "--out-dir", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "left.expression" in r.stderr
    assert not (tmp_path / MARKER).exists()


def test_relu_sum_expression_payload_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = _table("relu_sum/gelu-k2-primitive")
    t["expression"] = ("x.__class__.__new__.__globals__['__builtins__']['__import__']('os').system("
                       f"'touch {MARKER}') or x*Phi(x)")
    t["activation"] = "custom"
    p = _write(tmp_path, t)
    with pytest.raises(T.TableError, match="expression"):
        ReLUSumActivation(p)
    r = subprocess.run([sys.executable, "-m", "approxbp.cli", "fit", "relu-sum", "--activation",
                        t["expression"], "--bits", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "not allowed" in r.stderr
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("text,msg", [("Max(x, 0)", "not smooth"), ("x/0", "singular"), ("1/x", "singular"),
                                      ("log(x)", "singular"), ("10**10**10", "too large"), ("x(2)", "not an allowed")])
def test_bad_activation_expressions_get_one_clear_line(text, msg):
    from approxbp.approximations import get_activation

    with pytest.raises(ValueError, match=msg) as err:
        get_activation(text)
    assert "Traceback" not in str(err.value)


def test_generated_code_escapes_table_strings(tmp_path):
    t = _table("relu_sum/gelu-k2-primitive")
    t["activation"] = 'gelu""" + \\ import os; os.system("x") """'  # a free-form label, printable
    p = _write(tmp_path, t)
    code = compile(render(p, T.load(p)), "gen.py", "exec")  # compiles (nothing is run)
    assert code.co_consts[0].startswith(t["activation"])  # the docstring holds the name verbatim
    t["activation"] = 'gelu"""\nimport os; os.system("x")\n"""'
    with pytest.raises(T.TableError, match="printable"):
        T.validate(t)


def test_form_names_must_be_identifiers():
    from approxbp.approximations.invact_forms import Form

    with pytest.raises(ValueError, match="identifier"):
        Form.parse("y + a", {"os.system": 1.0})
    with pytest.raises(ExpressionError):
        Form.parse("y + a", {"a": 1.0}, [["c", "os.system"]])


# ---- 2. atomic writes --------------------------------------------------------------------------------------
def test_crash_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "t.json"
    T.save(_table("relu_sum/gelu-k2-primitive"), p)
    before = p.read_bytes()

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    t = _table("relu_sum/gelu-k3-primitive")
    with pytest.raises(OSError, match="No space"):
        T.save(t, p)
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind


def test_no_clobber_write_refuses_an_existing_file(tmp_path):
    p = write_atomic(tmp_path / "a.txt", "first", overwrite=False)
    with pytest.raises(FileExistsError):
        write_atomic(p, "second", overwrite=False)
    assert p.read_text() == "first"
    with pytest.raises(FileExistsError, match="--force"):
        T.save(_table("relu_sum/gelu-k2-primitive"), p, overwrite=False)


def test_cli_out_is_checked_before_the_fit(tmp_path):
    existing = tmp_path / "t.json"
    existing.write_text("{}")
    cases = [([str(existing)], "exists; pass --force"), ([str(tmp_path)], "is a folder")]
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        cases.append(([str(ro / "t.json")], "cannot write"))
    for out, msg in cases:
        r = subprocess.run([sys.executable, "-m", "approxbp.cli", "fit", "relu-sum", "--activation", "gelu",
                            "--bits", "8", "--restarts", "64", "--out", *out], capture_output=True, text=True,
                           timeout=60)  # a k=8, 64-restart fit takes minutes: the refusal must come first
        assert r.returncode == 2 and msg in r.stderr, (out, r.stderr)
    with pytest.raises(PermissionError):
        check_writable("/proc/no/such/folder/t.json")


# ---- 3. semantic checks ----------------------------------------------------------------------------------
def _mutate(name, fn):
    t = copy.deepcopy(_table(name))
    fn(t)
    return t


def _set(path, value):
    def fn(t):
        d = t
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return fn


BAD_TABLES = [
    ("relu_sum/gelu-k2-primitive-paper", _set(["weights"], [0.1, 1.0979632065417297, -0.048740595085551286]),
     "levels|constraint_residual"),
    ("relu_sum/gelu-k2-primitive", _set(["expression"], "x*sigmoid(x)"), "is not the activation 'gelu'"),
    ("relu_sum/gelu-k2-primitive", _set(["knots"], [-7.0, 0.0, 7.0]), "knots"),
    ("relu_sum/gelu-k2-primitive", _set(["knots"], [-3.0, -3.0, 3.0]), "strictly ascending"),
    ("invact/gelu-newton", lambda t: t["left"].__setitem__("domain", t["left"]["domain"][::-1]), "left.domain"),
    ("invact/gelu-newton", _set(["turning_point"], -0.70), "turning_point"),
    ("invact/gelu-newton", _set(["f_T"], -0.17), "f_T"),
    ("invact/gelu-newton", lambda t: t.pop("form"), "'form': missing"),
    ("invact/gelu-newton", _set(["form"], "x\nimport os"), "'form'"),
]


@pytest.mark.parametrize("name,fn,msg", BAD_TABLES)
def test_semantic_table_checks(name, fn, msg):
    t = _mutate(name, fn)
    with pytest.raises(T.TableError, match=msg):
        T.validate(t, name)


def test_paper_table_with_weights_not_summing_to_one_is_refused():
    t = _table("relu_sum/gelu-k2-primitive-paper")
    t["weights"][1] += 0.01
    t["levels"] = [0.0, t["weights"][0], t["weights"][0] + t["weights"][1], sum(t["weights"])]
    w, c = t["weights"], t["knots"]
    t["constraint_residual"] = max(abs(sum(w) - 1), abs(sum(a * b for a, b in zip(w, c))))
    with pytest.raises(T.TableError, match="Σw=1"):
        T.validate(t)


# ---- 4. reproducible bytes -------------------------------------------------------------------------------
def test_refitting_an_unchanged_table_changes_no_bytes(tmp_path):
    p = tmp_path / "t.json"
    t = _table("relu_sum/gelu-k2-primitive")
    T.save(t, p)
    before, mtime = p.read_bytes(), p.stat().st_mtime_ns
    t2 = copy.deepcopy(t)
    t2["created"], t2["provenance"]["seconds"] = "2099-01-01", 123.0
    assert T.definition_sha256(t2) == T.definition_sha256(t)
    T.save(t2, p)
    assert p.read_bytes() == before and p.stat().st_mtime_ns == mtime
    t2["weights"] = t2["weights"]  # a real change is written
    t2["metrics"]["tail_mass"] = 0.0
    T.save(t2, p)
    assert p.read_bytes() != before


def test_generated_kernels_record_the_definition_hash():
    from approxbp.kernels.modules import generated_module

    path = T.resolve("relu_sum/gelu-k2-primitive")
    t = T.load(path)
    assert generated_module(str(path), t.sha256, t.family).TABLE_SHA256 == T.definition_sha256(t)


def test_user_kernels_are_written_at_construction_never_in_a_forward(tmp_path):
    """Issue 15: a user table's module is generated when the drop-in is built; a forward only imports, and a
    missing module is an error that says what to run, not a silent write."""
    import shutil

    from approxbp.kernels import ReLUSumActivation

    path = T.save(T.load("relu_sum/silu-k2-primitive"), tmp_path / "relu_sum" / "mine-k2-primitive.json")
    ReLUSumActivation(str(path))  # CPU, twin path: the kernels are written all the same
    folder = tmp_path / "relu_sum" / "_generated"
    assert len(list(folder.glob("*.py"))) == 1
    shutil.rmtree(folder)
    m = ReLUSumActivation(str(path), use_triton=True)  # construction regenerates (and imports) it
    assert folder.is_dir()
    shutil.rmtree(folder)
    from approxbp.kernels.modules import generated_module

    generated_module.cache_clear()  # as in a fresh process that built the drop-in before the folder went
    with pytest.raises(RuntimeError, match="approxbp export"):
        m(torch.randn(8))
    assert not folder.exists()


# ---- 5. numerics -----------------------------------------------------------------------------------------
def _exact_grad(x: torch.Tensor, act: str) -> torch.Tensor:
    xd = x.double().detach().requires_grad_(True)
    f = torch.nn.functional.gelu if act == "gelu" else torch.nn.functional.silu
    f(xd).sum().backward()
    return xd.grad


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("cls,act", [(InvActGELU, "gelu"), (InvActSiLU, "silu")])
def test_invact_gradient_is_right_for_every_finite_input(cls, act, use_triton):
    big = torch.finfo(torch.float32).max
    x = torch.tensor([1e4, -1e4, 55.3, 315.2, 400.0, 1e6, 5e15, 1e30, big, -big, 1e-40, -1e-40, 1e-45, 0.0, 3.0, -3.0])
    x.requires_grad_(True)
    cls(use_triton=use_triton)(x).sum().backward()
    assert torch.isfinite(x.grad).all(), x.grad
    exact = _exact_grad(x.clamp(-1e4, 1e4), act).float()
    assert torch.allclose(x.grad, exact, atol=1e-5, rtol=0), (x.grad - exact).abs().max()  # fp32: see README


DROP_INS = [lambda u: ReGELU2(use_triton=u), lambda u: ReSiLU2(use_triton=u), lambda u: InvActGELU(use_triton=u),
            lambda u: InvActSiLU(use_triton=u), lambda u: MSLayerNorm(4, use_triton=u),
            lambda u: MSRMSNorm(4, use_triton=u)]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("make", DROP_INS, ids=["ReGELU2", "ReSiLU2", "InvActGELU", "InvActSiLU", "MSLN", "MSRMS"])
def test_nan_in_gives_nan_gradient_and_integers_are_refused(make, use_triton):
    m = make(use_triton)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    x.requires_grad_(True)
    m(x).sum().backward()
    assert torch.isnan(x.grad[1, 2])
    for bad in (torch.arange(12).view(3, 4), torch.ones(3, 4, dtype=torch.bool)):
        with pytest.raises(TypeError, match="floating-point"):
            m(bad)


@pytest.mark.parametrize("use_triton", [False, True])
def test_ms_norm_overflow_behaves_like_torch(use_triton):
    x = torch.tensor([[1e20, 2e20, 3e20, -1e20], [1.0, 2.0, 3.0, 4.0]])
    ln = torch.nn.LayerNorm(4, elementwise_affine=False)(x)
    rms = torch.nn.RMSNorm(4, elementwise_affine=False)(x)
    ours_ln, ours_rms = MSLayerNorm(4, use_triton=use_triton)(x), MSRMSNorm(4, use_triton=use_triton)(x)
    assert torch.equal(ours_ln.isnan(), ln.isnan()) and ours_ln[0].isnan().all()
    assert torch.allclose(ours_ln[1], ln[1], atol=1e-6)
    assert torch.allclose(ours_rms, rms, atol=1e-6, equal_nan=True)


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


def test_multi_dim_layernorm_is_skipped_not_broken():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm((8, 8)), torch.nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.normal_()
        model[0].bias.normal_()
    x = torch.randn(5, 8, 8)
    before = model(x)
    report = patch_model(model, activation=None)
    assert isinstance(model[0], torch.nn.LayerNorm) and "normalises over (8, 8)" in str(report.skipped)
    assert torch.equal(model(x), before)


@pytest.mark.parametrize("frozen", [True, False])  # merged into frozen consumers / α, β kept for trainable ones
def test_patching_is_all_or_nothing(monkeypatch, frozen):
    from approxbp.kernels import patch as P

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8, bias=False), torch.nn.GELU(),
                                torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    for ln in (model[0], model[3]):
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
    model.requires_grad_(not frozen)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def flaky(norm, consumers):
        calls.append(norm)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(norm, consumers)

    real = P.merge_norm if frozen else P.keep_affine
    monkeypatch.setattr(P, "merge_norm" if frozen else "keep_affine", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        patch_model(model)
    assert [type(m) for m in model] == [torch.nn.LayerNorm, torch.nn.Linear, torch.nn.GELU, torch.nn.LayerNorm,
                                        torch.nn.Linear]
    assert model[1].bias is None
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)


def test_tied_consumer_weight_is_not_merged():
    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(11, 8)
            self.ln_f = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 11, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

        def forward(self, ids):
            return self.lm_head(self.ln_f(self.wte(ids)))

    torch.manual_seed(0)
    m = TinyLM().double()
    with torch.no_grad():
        m.ln_f.weight.normal_()
        m.ln_f.bias.normal_()
    ids = torch.randint(0, 11, (2, 5))
    before = m(ids)
    frozen = copy.deepcopy(m).requires_grad_(False)
    report = patch_model(frozen, activation=None)  # merging into W would change the tied embedding too
    assert "tied weights" in str(report.skipped) and not report.norms
    report = patch_model(m, activation=None)  # trainable: α, β are kept, W is untouched, so tying is no obstacle
    assert len(report.norms) == 1 and m.lm_head.weight is m.wte.weight
    assert (m(ids) - before).abs().max() <= 1e-12 and (frozen(ids) - before).abs().max() <= 1e-12


# ---- BDIA --------------------------------------------------------------------------------------------------
def _blocks(n=3, d=8, bn=False, dtype=torch.float32):
    torch.manual_seed(1)
    layers = [torch.nn.Sequential(torch.nn.Linear(d, d), *( [torch.nn.BatchNorm1d(d)] if bn else []),
                                  torch.nn.Tanh()) for _ in range(n)]
    return [m.to(dtype) for m in layers]


def test_bdia_gamma_set_is_honoured_or_refused():
    from approxbp.approximations import bdia as B
    from approxbp.kernels.bdia import BDIAStack, bdia_reference

    mods = _blocks()
    with pytest.raises(ValueError, match="Table 3"):
        BDIAStack(mods, level=9, online=False, gammas=(0.25, -0.25))
    x = torch.randn(4, 8)
    only_half = BDIAStack(mods, level=9, gammas=(0.5,))(x, seed=3)
    ref = bdia_reference(mods, x, B.draw_gammas(3, 3, 4, (0.5,)), 9)
    assert torch.equal(only_half, ref)
    assert not torch.equal(only_half, BDIAStack(mods, level=9)(x, seed=3))  # the default set draws −0.5 too


@pytest.mark.parametrize("online", [True, False])
def test_bdia_keeps_dtype_and_updates_batchnorm_once(online):
    from approxbp.kernels.bdia import BDIAStack

    mods = _blocks(bn=True, dtype=torch.bfloat16)
    x = (torch.randn(6, 8) * 0.5).to(torch.bfloat16)
    y = BDIAStack(mods, level=3, online=online)(x, seed=0)
    assert y.dtype == torch.bfloat16
    stats = [m[1].running_mean.clone() for m in mods]
    y.float().sum().backward()
    assert all(m[1].num_batches_tracked.item() == 1 for m in mods)
    assert all(torch.equal(s, m[1].running_mean) for s, m in zip(stats, mods))


@pytest.mark.parametrize("level", [2.5, True, "9"])
def test_bdia_level_must_be_an_integer(level):
    from approxbp.kernels.bdia import BDIAStack

    with pytest.raises(TypeError, match="integer"):
        BDIAStack(_blocks(), level=level)


# ---- adversarial inputs for every drop-in (hypothesis) ----------------------------------------------------
SPECIAL = st.sampled_from([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-40, 0.0, -0.0,
                           1e4, -1e4, 1e20])


@settings(max_examples=30)
@given(values=st.lists(st.one_of(SPECIAL, st.floats(-50, 50, width=32)), min_size=1, max_size=64),
       which=st.integers(0, 3), use_triton=st.booleans())
def test_adversarial_inputs_activations(values, which, use_triton):
    m = [ReGELU2, ReSiLU2, InvActGELU, InvActSiLU][which](use_triton=use_triton)
    x = torch.tensor(values, dtype=torch.float32, requires_grad=True)
    y = m(x)
    y.backward(torch.ones_like(y))
    nan_in = torch.isnan(x.detach())
    assert torch.isnan(x.grad[nan_in]).all()
    if not nan_in.any():
        finite = torch.isfinite(x.detach())
        assert torch.isfinite(x.grad[finite]).all()
        assert torch.isfinite(y[finite]).all() or (x.detach()[finite].abs() > 1e38).any()
    if which >= 2:  # InvAct: the exact gradient to 5e-5 (the fast form in fp32) away from the turning point, where
        # y's own fp32 rounding limits any form to ~1e-4 (README)
        act, T = ("gelu", -0.7517915) if which == 2 else ("silu", -1.2784645)
        ok = torch.isfinite(x.detach()) & (x.detach().abs() < 1e4) & ((x.detach() - T).abs() > 0.1)
        assert torch.allclose(x.grad[ok], _exact_grad(x.detach()[ok], act).float(), atol=5e-5, rtol=0)


@settings(max_examples=20)
@given(values=st.lists(st.one_of(SPECIAL, st.floats(-50, 50, width=32)), min_size=4, max_size=4),
       center=st.booleans(), use_triton=st.booleans())
def test_adversarial_inputs_norms(values, center, use_triton):
    m = (MSLayerNorm if center else MSRMSNorm)(4, use_triton=use_triton)
    x = torch.tensor([values, [1.0, -2.0, 3.0, 0.5]], requires_grad=True)
    z = m(x)
    z.sum().backward()
    ref = (torch.nn.LayerNorm if center else torch.nn.RMSNorm)(4, elementwise_affine=False)(x.detach())
    assert torch.allclose(z[1], ref[1], atol=1e-5)  # a bad row leaves the other rows alone
    if torch.isnan(x.detach()[0]).any():
        assert torch.isnan(z[0]).all() and torch.isnan(x.grad[0]).all()
    assert torch.isfinite(x.grad[1]).all()
    assert not math.isnan(float(z[1].sum()))


def test_atomic_writes_keep_ordinary_permissions(tmp_path):
    new = write_atomic(tmp_path / "new.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert new.stat().st_mode & 0o777 == 0o666 & ~mask  # as open(..., "w") would make it, not mkstemp's 0600
    os.chmod(new, 0o640)
    write_atomic(new, "y")
    assert new.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
