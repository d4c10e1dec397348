"""Every generated kernel under TRITON_INTERPRET=1 (set in conftest) against the pure-PyTorch twin."""

import math

import numpy as np
import pytest
import torch
from _accuracy import tolerance_ok as _tolerance_ok
from _helpers import exact_grad as _exact_grad
from _helpers import exported
from _helpers import table_json as _table
from _helpers import write_json as _write
from approxbp.approximations import ReLUSum
from approxbp.approximations import tables as table_files
from approxbp.kernels import (
    InvActGELU,
    InvActSiLU,
    ReGELU2,
    ReLUSumActivation,
    ReLUSumSpec,
    ReSiLU2,
    saved_bytes,
)
from approxbp.kernels.codegen import HELPERS_MODULE, render, render_helpers
from approxbp.kernels.ops.modules import module_name
from approxbp.kernels.ops.packing import pack, storage_bits, unpack
from hypothesis import given, settings
from hypothesis import strategies as st

TABLES = table_files.table_paths("relu-sum")
IDS = [p.stem for p in TABLES]


def test_committed_triton_helpers_are_what_codegen_renders():
    assert HELPERS_MODULE.read_text() == render_helpers(), "run `approxbp export`"


@pytest.mark.parametrize("path", TABLES, ids=IDS)
def test_kernel_forward_backward_match_twin(path):
    spec = ReLUSumSpec(path)
    x = torch.cat([torch.linspace(-12, 12, 4093), torch.tensor(spec.table["knots"], dtype=torch.float32),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    y1, p1, n1 = spec.forward_triton(x)
    y0, p0, n0 = spec.forward_torch(x)
    assert torch.equal(p1, p0), "codes must agree bit for bit"
    assert torch.equal(n1, n0) and n0.tolist() == [0] * (n0.numel() - 1) + [1], "the NaN sits in the last block"
    row_bytes = max(4, spec.storage)  # whole rows of 8 codes, whole int32 words
    assert p1.numel() == row_bytes * math.ceil(x.numel() * spec.storage / (8 * row_bytes))
    assert torch.equal(p0[: math.ceil(x.numel() * spec.storage / 8)], pack(torch.bucketize(x, spec.knots64.float()),
                                                                            spec.storage))  # the same bytes as pack
    truth = torch.tensor(np.asarray(_truth(spec, x.double().numpy())), dtype=torch.float64)
    assert _tolerance_ok(y1[:-3], y0[:-3], truth[:-3], x[:-3], spec.table["activation"])
    g = torch.randn_like(x)
    d1, d0 = spec.backward_triton(g, p1, n1, x.numel()), spec.backward_torch(g, p0, n0, x.numel())
    assert torch.equal(d1.isnan(), d0.isnan()) and torch.equal(d1.nan_to_num(), d0.nan_to_num())
    assert torch.isnan(d0[-1]) and not torch.isnan(d0[: -spec.nan_span]).any()


def _truth(spec, xs):
    from approxbp.approximations import get_activation

    return get_activation(spec.table["expression"]).f(xs)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@given(n=st.sampled_from([0, 1, 7, 8, 9, 1001]), seed=st.integers(0, 2**16))
def test_pack_unpack_identity(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=g)
    packed = pack(codes, bits)
    assert packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack(packed, bits, n), codes)


def test_storage_widths():
    assert [storage_bits(k) for k in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@given(data=st.data())
def test_backward_is_grad_times_table_derivative(use_triton, dtype, data):
    spec_name = data.draw(st.sampled_from(["gelu-k2-primitive", "silu-k3-derivative", "mish-k4-primitive"]))
    shape = data.draw(st.sampled_from([(0,), (1,), (7,), (3, 5), (2, 9, 4)]))
    m = ReLUSumActivation(spec_name, use_triton=use_triton)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999)))) * 4).to(dtype)
    x.requires_grad_(True)
    y = m(x)
    assert y.dtype == dtype and y.shape == x.shape
    g = torch.randn(shape).to(dtype)
    y.backward(g)
    rs = ReLUSum(m.spec.table["weights"], m.spec.table["knots"])
    deriv = torch.tensor(rs.levels, dtype=torch.float32)[torch.bucketize(x.detach().float(), m.spec.consts("cpu")[0])]
    expected = (g.float() * deriv).to(dtype)
    if use_triton and dtype == torch.bfloat16:
        # the CPU interpreter truncates fp32→bf16 even when asked for round-to-nearest-even: ≤ 1 bf16 ulp
        assert torch.all((x.grad.float() - expected.float()).abs() <= 2**-7 * expected.float().abs())
    else:
        assert torch.equal(x.grad, expected)
    # forward: no worse than torch's own evaluation in that dtype, against float64
    truth = torch.tensor(np.asarray(_truth(m.spec, x.detach().double().numpy())))
    twin = m.spec.module.activation_twin  # the generated twin's evaluation (the CPU path returns torch's own op)
    torch_ref = twin(x.detach()) if dtype == torch.float32 else twin(x.detach().float()).to(dtype)
    assert _tolerance_ok(y.detach(), torch_ref, truth, x, m.spec.table["activation"])


def test_non_contiguous_input():
    m = ReGELU2(use_triton=True)
    base = torch.randn(8, 6, requires_grad=True)
    x = base.t()
    assert not x.is_contiguous()
    y = m(x)
    y.sum().backward()
    ref = ReGELU2(use_triton=False)
    base2 = base.detach().clone().requires_grad_(True)
    ref(base2.t()).sum().backward()
    assert torch.equal(base.grad, base2.grad)


def test_nan_in_gradient_propagates_and_nan_input_is_not_zeroed():
    m = ReSiLU2(use_triton=True)
    x = torch.tensor([1.0, float("nan"), -2.0], requires_grad=True)
    y = m(x)
    assert torch.isnan(y[1])
    y.backward(torch.tensor([float("nan"), 1.0, 1.0]))
    assert torch.isnan(x.grad[0]) and torch.isnan(x.grad[1])  # a NaN input gives a NaN gradient, as in torch


@pytest.mark.parametrize("name,bits", [("gelu-k2-primitive", 2), ("gelu-k3-primitive", 4), ("silu-k8-primitive", 8)])
def test_saved_bytes_per_element(name, bits):
    m = ReLUSumActivation(name)
    x = torch.randn(4096, requires_grad=True)
    assert saved_bytes(lambda: m(x)) == 4096 * bits // 8 + math.ceil(4096 / m.spec.nan_span)  # codes + NaN bytes
    gelu = torch.nn.GELU()
    assert saved_bytes(lambda: gelu(x)) == 4096 * 4  # torch saves the fp32 input


def test_gradcheck_of_the_pure_torch_approximant():
    rs = ReLUSum([-0.05, 1.1, -0.05], [-3.0, 0.0, 3.0])
    w, c = torch.tensor(rs.weights), torch.tensor(rs.knots)
    x = torch.tensor([-4.1, -2.2, -0.7, 0.4, 1.9, 3.3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: (torch.relu(v[:, None] - c) * w).sum(1), (x,))


def test_a_template_slot_in_a_label_stays_text(tmp_path):
    """A label holding "{helpers}" used to be replaced by an import line inside the generated module."""
    from approxbp.kernels.codegen import render

    t = table_files.load("relu_sum/mish-k2-primitive").to_json() | {"activation": "my {helpers} act"}
    path = table_files.save(t, tmp_path / "mine-k2-primitive.json")
    text = render(path)
    compile(text, "m.py", "exec")
    assert "ACTIVATION = 'my {helpers} act'" in text and text.count("generated.triton_helpers import") <= 1


def test_user_module_names_do_not_collide(tmp_path):
    a = exported(table_files.load("relu_sum/silu-k2-primitive"), tmp_path / "a-b.json")
    b = exported(table_files.load("relu_sum/gelu-k2-primitive"), tmp_path / "a_b.json")
    assert module_name(a) != module_name(b)
    x = torch.linspace(-4, 4, 64)
    ya = ReLUSumSpec(a)
    yb = ReLUSumSpec(b)
    assert torch.allclose(ya.forward_triton(x)[0], torch.nn.functional.silu(x), atol=1e-6)
    assert torch.allclose(yb.forward_triton(x)[0], torch.nn.functional.gelu(x), atol=1e-6)


def _phi_float32(x: np.ndarray) -> np.ndarray:
    """The kernels' 16-bit-data Φ(x) (triton_helpers._phi with LOWP), operation by operation in numpy float32."""
    from approxbp.approximations.elementary import LOG2E, PHI_TAIL_P, phi_tail

    f32 = np.float32
    t = f32(1) / (f32(1) + f32(PHI_TAIL_P) * np.abs(x))
    coeffs = phi_tail()
    p = np.full_like(x, f32(coeffs[-1]))
    for c in reversed(coeffs[:-1]):
        p = p * t + f32(c)
    with np.errstate(over="ignore", under="ignore"):
        q = t * np.exp2(p - (x * x) * f32(LOG2E / 2))
    return np.where(x < 0, q, f32(1) - q)


def _every_finite(dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


def _midpoint_distance(exact: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """The correctly rounded value of each exact float64 number in ``dtype`` and the exact number's distance to the
    nearest rounding midpoint (its neighbours in ``dtype`` by bit pattern)."""
    rounded = torch.from_numpy(exact).to(dtype)
    bits = rounded.view(torch.int16).int()
    neighbour = lambda step: (bits + step).to(torch.int16).view(dtype).double().numpy()  # noqa: E731
    r = rounded.double().numpy()
    with np.errstate(invalid="ignore"):
        dist = np.minimum(np.abs(exact - (r + neighbour(1)) / 2), np.abs(exact - (r + neighbour(-1)) / 2))
    return rounded, dist


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_forward_of_every_16_bit_input(dtype):
    """Exhaustive: the kernels' 16-bit GELU (x·Φ with Φ's tail t·2^(P(t) − x²·log2(e)/2), no erf) on all 63 488 /
    65 280 finite inputs against x·ndtr(x) in float64. bf16: every output is the correctly rounded GELU (F.gelu, whose
    1 + erf cancels in the left tail, misses it at hundreds of inputs), and stays so with 4e-7 of relative slack
    for the GPU's MUFU approximations and FMA contraction. fp16: only near-ties (within 3e-7 of a midpoint) differ,
    by one ulp."""
    from scipy.special import ndtr

    x = _every_finite(dtype)
    spec = ReLUSumSpec(table_files.relu_sum_name("gelu", 2, "derivative", "fit"))
    y32 = torch.empty(x.shape)  # the generated activation in float32, rounded by torch (the interpreter rounds
    _ACTIVATION_KERNEL[(1,)](x, y32, x.numel(), spec.module.activation, BLOCK=2**16)  # to bf16 by truncation)
    y = y32.to(dtype)
    xs = x.double().numpy()
    exact = xs * ndtr(xs)
    rounded, dist = _midpoint_distance(exact, dtype)
    normal = np.abs(exact) >= torch.finfo(dtype).tiny
    wrong = (y.double().numpy() != rounded.double().numpy()) & normal
    torch_wrong = (torch.nn.functional.gelu(x).double().numpy() != rounded.double().numpy()) & normal
    assert torch_wrong.sum() > 100  # the reference is not F.gelu itself
    if dtype == torch.bfloat16:
        assert not wrong.any(), xs[wrong][:10]
        emulated = (xs * _phi_float32(xs.astype(np.float32)).astype(np.float64))
        assert np.all((np.abs(emulated - exact) + 4e-7 * np.abs(exact) < dist)[normal])
    else:
        assert wrong.sum() <= 8 and np.all(dist[wrong] < 3e-7 * np.abs(exact[wrong])), xs[wrong]
        ulp = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"), dtype=dtype)) - rounded.abs()).double()
        assert np.all(np.abs(y.double().numpy() - rounded.double().numpy())[wrong] <= ulp.numpy()[wrong])


import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from approxbp.approximations import table_schema as TS  # noqa: E402


@triton.jit
def _ACTIVATION_KERNEL(x_ptr, y_ptr, n, activation: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N802
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, activation(x.to(tl.float32), x.dtype.primitive_bitwidth <= 16), mask=offs < n)


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----





SPECIAL = st.sampled_from([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-40, 0.0, -0.0,
                           1e4, -1e4, 1e20])


def test_generated_code_escapes_table_strings(tmp_path):
    t = _table("relu_sum/gelu-k2-primitive")
    t["activation"] = 'gelu""" + \\ import os; os.system("x") """'  # a free-form label, printable
    p = _write(tmp_path, t)
    code = compile(render(p, table_files.load(p)), "gen.py", "exec")  # compiles (nothing is run)
    assert code.co_consts[0].startswith(t["activation"])  # the docstring holds the name verbatim
    t["activation"] = 'gelu"""\nimport os; os.system("x")\n"""'
    with pytest.raises(TS.TableError, match="printable"):
        table_files.validate(t)


def test_generated_kernels_record_the_definition_hash():
    from approxbp.kernels.ops.modules import generated_module

    path = table_files.resolve("relu_sum/gelu-k2-primitive")
    t = table_files.load(path)
    assert generated_module(path, t.family).TABLE_SHA256 == table_files.definition_sha256(t)


def test_user_kernels_come_from_export_and_construction_only_reads_them(tmp_path):
    """A drop-in never writes kernels. A user table without them is refused at construction with the
    command to run; after `approxbp export` it builds; a table edited since is refused as stale."""
    from approxbp.kernels import ReLUSumActivation

    path = table_files.save(table_files.load("relu_sum/silu-k2-primitive"),
                            tmp_path / "relu_sum" / "mine-k2-primitive.json")
    folder = tmp_path / "relu_sum" / "_generated"
    with pytest.raises(RuntimeError, match="approxbp export .*mine-k2-primitive.json"):
        ReLUSumActivation(str(path))
    assert not folder.exists()
    exported(table_files.load(path), path)
    m = ReLUSumActivation(str(path), use_triton=True)
    assert torch.allclose(m(torch.linspace(-3, 3, 8)), torch.nn.functional.silu(torch.linspace(-3, 3, 8)), atol=1e-6)
    table_files.save(table_files.load(path).with_metrics(note=1.0), path)  # another definition, same file
    with pytest.raises(RuntimeError, match="another version"):
        ReLUSumActivation(str(path))


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
