"""The suite's faster interpreter reduction (tests/support/_interpreter.py) gives what Triton's own element-by-element
one gives: NaN-propagating maxima on fp32 and bf16 with NaNs anywhere, a combine whose operand order matters, a
two-tensor reduction, every axis and keep_dims."""

import os

import pytest
import torch
import triton
import triton.language as tl
from _interpreter import pairwise_reduce

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's reduction")


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL).to(a.dtype)


@triton.jit
def _last_nonzero(a, b):  # associative, not commutative
    return tl.where(b != 0, b, a)


@triton.jit
def _max_and_first_index(a, i, b, j):
    take_b = (b > a) | ((b == a) & (j < i))
    return tl.where(take_b, b, a), tl.where(take_b, j, i)


@triton.jit
def _reductions(x_ptr, all_ptr, rows_ptr, kept_ptr, last_ptr, value_ptr, index_ptr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(all_ptr, tl.reduce(x, None, _nan_max))
    tl.store(rows_ptr + tl.arange(0, R), tl.reduce(x, 1, _nan_max))
    tl.store(kept_ptr + tl.arange(0, C)[None, :], tl.reduce(x, 0, _nan_max, keep_dims=True))
    tl.store(last_ptr + tl.arange(0, R), tl.reduce(tl.where(x > 0.5, x, 0.0).to(x.dtype), 1, _last_nonzero))
    value, index = tl.reduce((x.to(tl.float32), offs), 1, _max_and_first_index)
    tl.store(value_ptr + tl.arange(0, R), value)
    tl.store(index_ptr + tl.arange(0, R), index)


def _run(x):
    R, C = x.shape
    out = [torch.empty(1, dtype=x.dtype), torch.empty(R, dtype=x.dtype), torch.empty(C, dtype=x.dtype),
           torch.empty(R, dtype=x.dtype), torch.empty(R), torch.empty(R, dtype=torch.int64)]
    _reductions[(1,)](x, *out, R, C)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 8), (2, 4), (1, 8)])
def test_pairwise_reduction_is_the_interpreters_own(dtype, shape, monkeypatch):
    from triton.runtime.interpreter import ReduceOps

    assert ReduceOps.generic_reduce is pairwise_reduce, "tests/conftest.py installs it on this Triton"
    g = torch.Generator().manual_seed(0)
    for nans in (0, 1, 3):
        x = torch.rand(shape, generator=g).to(dtype)
        x.view(-1)[torch.randperm(x.numel(), generator=g)[:nans]] = float("nan")
        ours = _run(x)
        with monkeypatch.context() as m:
            m.setattr(ReduceOps, "generic_reduce", ReduceOps.stock_generic_reduce)
            stock = _run(x)
        for a, b in zip(ours, stock):
            assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), (a, b)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (x, a, b)
