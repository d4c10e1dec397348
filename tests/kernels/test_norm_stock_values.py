"""Issue 59 item 2: a rewritten norm returns the stock value bit for bit, for every input.

Property tests (hypothesis) over extreme rows — zeros, 1e±30, overflowing variances, NaN/Inf entries — in
contiguous, transposed and channels-last layouts, fp16/bf16/fp32/fp64, for every norm form the prover knows
(torch's LayerNorm and RMSNorm with and without affine, Llama's and T5's RMSNorm written in fp32 elementwise ops,
Gemma's α = 1 + w, OLMo's LayerNorm without weight). The reference is the stock module itself, run on the same
input: equal values (NaN where it is NaN), dtype and strides. The drop-ins alone (MSLayerNorm, MSRMSNorm) equal
torch's layer_norm / rms_norm without affine the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from approxbp.kernels.ops.norms import MSLayerNorm, MSRMSNorm
from approxbp.kernels.rewrite.norm_merge import keep_affine
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

D = 16
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _hf(module: str, cls: str, *args, **kwargs):
    transformers = pytest.importorskip("transformers")
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[cls])
    assert transformers is not None
    return getattr(mod, cls)(*args, **kwargs)


def _randomised(norm: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return norm


FORMS = {
    "nn.LayerNorm": lambda: nn.LayerNorm(D),
    "nn.LayerNorm(bias=False)": lambda: nn.LayerNorm(D, bias=False),
    "nn.LayerNorm(no affine)": lambda: nn.LayerNorm(D, elementwise_affine=False),
    "nn.RMSNorm": lambda: nn.RMSNorm(D, eps=1e-6),
    "nn.RMSNorm(eps=None)": lambda: nn.RMSNorm(D),
    "LlamaRMSNorm": lambda: _hf("llama", "LlamaRMSNorm", D),
    "T5LayerNorm": lambda: _hf("t5", "T5LayerNorm", D),
    "GemmaRMSNorm (1 + w)": lambda: _hf("gemma", "GemmaRMSNorm", D),
    "OlmoLayerNorm (no weight)": lambda: _hf("olmo", "OlmoLayerNorm", D),
}


def _row(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(D, generator=g, dtype=torch.float64)
    if kind == "zeros":
        return torch.zeros(D, dtype=torch.float64)
    if kind == "constant":
        return torch.full((D,), float(r[0]) * 1e3, dtype=torch.float64)
    if kind.startswith("scale"):
        return r * float(kind[5:])
    if kind == "overflowing variance":
        return r.sign() * 3e38
    if kind == "nan entry":
        return r.index_fill(0, torch.tensor([seed % D]), float("nan"))
    if kind == "inf entry":
        return r.index_fill(0, torch.tensor([seed % D]), float("inf") if seed % 2 else float("-inf"))
    if kind == "offset":  # a large mean beside a small spread
        return r + 1e4
    return r


KINDS = ["plain", "zeros", "constant", "scale1e-30", "scale1e30", "scale1e-3", "scale1e4", "overflowing variance",
         "nan entry", "inf entry", "offset"]
rows = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2**16)), min_size=1, max_size=6)


def _input(spec, dtype, layout: str) -> torch.Tensor:
    x = torch.stack([_row(kind, seed) for kind, seed in spec]).to(dtype)  # (rows, D): inf/overflow as the dtype has
    if layout == "transposed":  # (2, rows, D) whose last dimension is not the fastest
        return torch.stack([x, -x]).transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "channels_last":  # (1, rows, 1, D) in channels-last memory format
        return x[None, :, None, :].contiguous(memory_format=torch.channels_last)
    return x


def _assert_stock(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", list(FORMS))
@settings(max_examples=25, deadline=None, derandomize=True)
@given(spec=rows, layout=st.sampled_from(["contiguous", "transposed", "channels_last"]), grad=st.booleans())
def test_rewritten_norm_returns_the_stock_value(form, dtype, spec, layout, grad):
    stock = _randomised(FORMS[form]()).to(dtype)
    ms, _ = keep_affine(copy.deepcopy(stock), [], shared_output=True)
    x = _input(spec, dtype, layout)
    with torch.no_grad():
        want = stock(x)
    got = ms(x.requires_grad_(grad))
    _assert_stock(got.detach(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cls", [MSLayerNorm, MSRMSNorm])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(spec=rows, layout=st.sampled_from(["contiguous", "transposed", "channels_last"]),
       eps=st.sampled_from([1e-5, 1e-6, None]))
def test_drop_in_norm_is_torchs_norm_without_affine(cls, dtype, spec, layout, eps):
    if cls is MSLayerNorm and eps is None:
        eps = 1e-12
    x = _input(spec, dtype, layout).requires_grad_()
    want = (nn.functional.layer_norm(x, (D,), eps=eps) if cls is MSLayerNorm
            else nn.functional.rms_norm(x, (D,), eps=eps))
    _assert_stock(cls(D, eps=eps, use_triton=False)(x).detach(), want.detach())


def test_stock_value_where_the_old_arithmetic_was_not():
    """The rows of the issue: an fp32 LayerNorm row whose variance overflows (stock NaN at ≳ 2e19 only where torch
    says so), a float64 Llama norm (stock computes in fp32 inside), bf16 Gemma at d = 1000 (z was rounded to bf16
    before α⊙z + β: 796 of 3000 outputs differed)."""
    g = torch.Generator().manual_seed(0)
    cases = [(nn.LayerNorm(8), torch.randn(3, 8, generator=g) * 3e19),
             (_hf("llama", "LlamaRMSNorm", 8).double(), torch.randn(3, 8, generator=g, dtype=torch.float64) * 1e200),
             (_randomised(_hf("gemma", "GemmaRMSNorm", 1000)).bfloat16(),
              torch.randn(3, 1000, generator=g).bfloat16())]
    for stock, x in cases:
        ms, _ = keep_affine(copy.deepcopy(stock), [], shared_output=True)
        _assert_stock(ms(x.requires_grad_()).detach(), stock(x).detach())


def test_gradients_still_flow_through_z():
    """The stock value is only what the forward returns: x, α and β get their gradients through z (float64)."""
    stock = _randomised(nn.LayerNorm(D)).double()
    ms, _ = keep_affine(copy.deepcopy(stock), [], shared_output=True)
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, D, dtype=torch.float64)
    want = torch.autograd.grad(stock(x), [x, *stock.parameters()], dy)
    got = torch.autograd.grad(ms(x), [x, *ms.parameters()], dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
