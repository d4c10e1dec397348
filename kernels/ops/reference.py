"""Plain one-line Triton kernels of the exact GELU and SiLU, forward and backward: the baseline that
``approxbp cost`` sets beside the generated kernels (what torch's own element-wise kernels cost)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["BLOCK", "KERNELS"]


#: Elements per program (as the ReLU-sum kernels' span).
BLOCK = 4096


@triton.jit
def _gelu_fwd(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _gelu_bwd(g_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=offs < n).to(tl.float32)
    d = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _silu_fwd(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(y_ptr + offs, (x * tl.sigmoid(x)).to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _silu_bwd(g_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=offs < n).to(tl.float32)
    s = tl.sigmoid(x)
    tl.store(dx_ptr + offs, (g * s * (1.0 + x * (1.0 - s))).to(dx_ptr.dtype.element_ty), mask=offs < n)


#: activation → (forward kernel, backward kernel)
KERNELS = {"gelu": (_gelu_fwd, _gelu_bwd), "silu": (_silu_fwd, _silu_bwd)}
