"""BDIA for training (BDIA-transformer §4.3): the fused quantised update (eq. 21) and its exact inverse
(eq. 24) as Triton kernels with pure-PyTorch twins, and online back-propagation through a stack of K
residual blocks that keeps only (x_{K−1}, x_K), 1 packed side bit per element per block, the γ seed and
each block's RNG state.

Online backward replays, for k = K−1…1, h_k(x_k) under the forward's RNG state, rebuilds x_{k−1} with
eq. 24, and back-propagates through a local graph made of the same operations, in the same order, as the
ordinary autograd graph of :func:`bdia_reference` (including the γ-term of block k+1 that also reads x_k), so
every gradient sum is associated the same way and the gradients are bitwise equal to ordinary autograd's.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch
import triton
import triton.language as tl
from approxbp.approximations import bdia as B

from .launch import BIT_BLOCK_BYTES, num_warps
from .packing import pack, unpack

__all__ = ["bdia_reference", "BDIAStack", "BDIAStackFunction", "inverse_torch", "inverse_triton", "launch_inverse",
           "launch_step", "step_torch", "step_triton"]


@triton.jit
def _round_half_even(v):
    # v − floor(v) is exact in floating point, so the tie test is exact too
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(0.5 * f)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _byte_tile(BLOCK: tl.constexpr):
    """This program's BLOCK bytes and their [BLOCK, 8] element offsets (bit j of byte b is element 8b + j)."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    return byte, lane, byte[:, None] * 8 + lane[None, :]


@triton.jit
def _wide(v):
    """16-bit data is computed in fp32 (tl.floor has no 16-bit form); fp32 and fp64 stay."""
    if v.dtype.primitive_bitwidth < 32:
        v = v.to(tl.float32)
    return v


@triton.jit
def _operands(a_ptr, x_ptr, h_ptr, gamma_ptr, offs, inside, row):
    """The three states' elements (x_{k−1} or x_{k+1}, x_k, h_k) of this tile, computed wide, and each element's γ
    (one per row of ``row`` elements: one per sample)."""
    a = _wide(tl.load(a_ptr + offs, mask=inside, other=0.0))
    x = _wide(tl.load(x_ptr + offs, mask=inside, other=0.0))
    h = _wide(tl.load(h_ptr + offs, mask=inside, other=0.0))
    return a, x, h, _wide(tl.load(gamma_ptr + offs // row, mask=inside, other=0.5))


@triton.jit
def _rnd(v, ty: tl.constexpr):
    """v rounded to the storage dtype ``ty`` (round to nearest even), as torch's op in ``ty`` rounds it; kept wide
    for the next op, so 16-bit results equal the twin's op for op."""
    if ty.primitive_bitwidth < v.dtype.primitive_bitwidth:
        v = v.to(ty, fp_downcast_rounding="rtne").to(v.dtype)
    return v


@triton.jit
def _rest_grid(x, h, g, scale, ty: tl.constexpr):
    """2^l·Q_l[(1−γ)x_k + (1+γ)h_k]: the x_k-term of eqs. 21 and 24 as a grid integer (each op rounded to ``ty``)."""
    return _round_half_even(_rnd(_rnd((1.0 - g) * x, ty) + _rnd((1.0 + g) * h, ty), ty) * scale)


@triton.jit
def _step_kernel(xp_ptr, x_ptr, h_ptr, gamma_ptr, out_ptr, bits_ptr, n_elem, row, n_bytes, scale,
                BLOCK: tl.constexpr):
    """Eq. 21: out = Q[γ(x_{k−1} + s/scale)] + Q[(1−γ)x_k + (1+γ)h], s = X_{k−1} odd; bits packed 8 per byte.
    Under the exactness bound every grid value is exact in the storage dtype; only the mix rounds."""
    byte, lane, offs = _byte_tile(BLOCK)
    inside = offs < n_elem
    ty: tl.constexpr = out_ptr.dtype.element_ty
    xp, x, h, g = _operands(xp_ptr, x_ptr, h_ptr, gamma_ptr, offs, inside, row)
    X = xp * scale  # an integer: x_{k−1} is on the 2^{-l} grid
    s = (X - 2.0 * tl.floor(0.5 * X)) == 1.0
    first = _round_half_even(g * (X + s.to(X.dtype)))
    second = _rest_grid(x, h, g, scale, ty)
    tl.store(out_ptr + offs, _rnd(first / scale + second / scale, ty).to(ty), mask=inside)
    word = tl.sum(tl.where(inside & s, 1 << lane[None, :], 0), axis=1)
    tl.store(bits_ptr + byte, word.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _inverse_kernel(x_ptr, xn_ptr, h_ptr, gamma_ptr, bits_ptr, out_ptr, n_elem, row, n_bytes, scale,
                   BLOCK: tl.constexpr):
    """Eq. 24: out = x_{k+1}/γ − s/scale − Q[(1−γ)x_k + (1+γ)h]/γ."""
    byte, lane, offs = _byte_tile(BLOCK)
    inside = offs < n_elem
    ty: tl.constexpr = out_ptr.dtype.element_ty
    xn, x, h, g = _operands(xn_ptr, x_ptr, h_ptr, gamma_ptr, offs, inside, row)
    word = tl.load(bits_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    s = ((word[:, None] >> lane[None, :]) & 1).to(x.dtype)
    q = _rest_grid(x, h, g, scale, ty) / scale
    tl.store(out_ptr + offs, _rnd((xn - q) / g - s / scale, ty).to(ty), mask=inside)


def _flat_gamma(gamma: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    gamma = gamma.to(x.device, x.dtype).reshape(-1).contiguous()
    if x.numel() % max(gamma.numel(), 1):
        raise ValueError(f"γ has {gamma.numel()} entries, which does not divide numel {x.numel()} into rows")
    return gamma, max(x.numel() // max(gamma.numel(), 1), 1)


def step_triton(x_prev, x, hx, gamma: torch.Tensor, level: int, block: int = 0):
    """Triton eq. 21 (same contract as :func:`approxbp.approximations.bdia.step`; γ is one value per sample)."""
    B.check_gamma(gamma)
    for v in (x_prev, x):
        B.check_representable(v, level, block)
    xp, xc, hc = (t.contiguous() for t in (x_prev, x, hx.to(x.dtype)))
    g, row = _flat_gamma(gamma, xc)
    out, bits = launch_step(xp, xc, hc, g, row, level)
    B.check_representable(out, level, block)
    return out, bits


def launch_step(xp, xc, hc, g, row: int, level: int):
    """The launch of :func:`_step_kernel` on contiguous tensors (no checks): (out, packed side bits)."""
    out = torch.empty_like(xc)
    n = xc.numel()
    bits = torch.empty(math.ceil(n / 8), dtype=torch.uint8, device=xc.device)
    if n:
        grid = (triton.cdiv(bits.numel(), BIT_BLOCK_BYTES),)
        _step_kernel[grid](xp, xc, hc, g, out, bits, n, row, bits.numel(), 2.0**level, BLOCK=BIT_BLOCK_BYTES,
                          num_warps=num_warps(xc.dtype), enable_fp_fusion=False)
    return out, bits


def inverse_triton(x, x_next, hx, bits, gamma: torch.Tensor, level: int, block: int = 0):
    """Triton eq. 24 with packed side bits."""
    B.check_gamma(gamma)
    for v in (x, x_next):
        B.check_representable(v, level, block)
    xc, xn, hc = (t.contiguous() for t in (x, x_next, hx.to(x.dtype)))
    g, row = _flat_gamma(gamma, xc)
    return launch_inverse(xc, xn, hc, bits, g, row, level)


def launch_inverse(xc, xn, hc, bits, g, row: int, level: int):
    """The launch of :func:`_inverse_kernel` on contiguous tensors (no checks)."""
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        grid = (triton.cdiv(bits.numel(), BIT_BLOCK_BYTES),)
        _inverse_kernel[grid](xc, xn, hc, g, bits, out, n, row, bits.numel(), 2.0**level, BLOCK=BIT_BLOCK_BYTES,
                             num_warps=num_warps(xc.dtype), enable_fp_fusion=False)
    return out


def step_torch(x_prev, x, hx, gamma: torch.Tensor, level: int, block: int = 0):
    """The PyTorch twin of :func:`step_triton`: eq. 21 and the packed side bits."""
    x_next, s = B.step(x_prev, x, hx, B.per_sample(gamma, x), level, block)
    return x_next, pack(s, 1)


def inverse_torch(x, x_next, hx, bits, gamma: torch.Tensor, level: int, block: int = 0):
    """The PyTorch twin of :func:`inverse_triton`."""
    s = unpack(bits, 1, x.numel()).view(x.shape).to(x.dtype)
    return B.inverse(x, x_next, hx, s, B.per_sample(gamma, x), level, block)


def bdia_reference(blocks, x, gammas: torch.Tensor, level: int) -> torch.Tensor:
    """Eqs. 18–21 through ordinary autograd (every activation kept): the oracle for online back-propagation."""
    return B.run(blocks, x, gammas, level)[0][-1]


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _replay(block, x, state, device):
    """h_k(x) under the RNG state the forward saw (dropout replays the same mask)."""
    if state is None:
        return block(x)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        return block(x)


@contextlib.contextmanager
def _buffers_kept(block):
    """Put back every buffer a replay changes (BatchNorm running statistics): the forward updated them once.
    Restored on exit, after the local backward passes, which may read them."""
    saved = [(b, b.detach().clone()) for b in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


class BDIAStackFunction(torch.autograd.Function):
    """Online back-propagation through K BDIA blocks (Prop. 4.4); parameters are passed as inputs."""

    @staticmethod
    def forward(ctx, x, blocks, seed, level, preserve_rng, use_triton, gamma_set, *params):
        K = len(blocks)
        gammas = B.draw_gammas(seed, K, x.shape[0], gamma_set).to(x.dtype)
        step = step_triton if use_triton else step_torch
        x0 = B.quantize(x, level)
        states = [_rng_state(x.device) if preserve_rng else None]
        x1 = B.first_step(x0, blocks[0](x0), level)
        prev, cur, bits = x0, x1, []
        for k in range(1, K):
            states.append(_rng_state(x.device) if preserve_rng else None)
            nxt, b = step(prev, cur, blocks[k](cur), gammas[k - 1], level, k)
            bits.append(b)
            prev, cur = cur, nxt
        ctx.blocks, ctx.seed, ctx.level, ctx.use_triton, ctx.gamma_set = blocks, seed, level, use_triton, gamma_set
        ctx.save_for_backward(prev, cur, *bits, *(states if preserve_rng else []))
        return cur

    @staticmethod
    def backward(ctx, grad):
        blocks, level, K = ctx.blocks, ctx.level, len(ctx.blocks)
        saved = [t.detach() for t in ctx.saved_tensors]  # x_K is the output: cut it from this graph
        x_prev_top, x_top = saved[0], saved[1]
        bits = saved[2:K + 1]
        states = saved[K + 1:] or [None] * K
        gammas = B.draw_gammas(ctx.seed, K, x_top.shape[0], ctx.gamma_set).to(x_top.dtype)
        device = x_top.device
        params = [list(b.parameters()) for b in blocks]
        param_grads: list = [None] * K
        a_next2 = None  # dL/dx_{k+2}
        a_next = grad  # dL/dx_{k+1}
        x_next, x = x_top, x_prev_top
        s_k = None  # side bits of x_k (unpacked once, at the block that reconstructs x_k)
        with torch.enable_grad(), contextlib.ExitStack() as keep:
            for block in blocks:
                keep.enter_context(_buffers_kept(block))
            for k in range(K - 1, -1, -1):
                xk = x.detach().requires_grad_(True)
                hx = _replay(blocks[k], xk, states[k], device)
                if k >= 1:
                    g = B.per_sample(gammas[k - 1], x)
                    s_prev = unpack(bits[k - 1], 1, x.numel()).view(x.shape).to(x.dtype)
                    x_prev = (inverse_triton(x, x_next, hx.detach(), bits[k - 1], gammas[k - 1], level, k)
                              if ctx.use_triton else B.inverse(x, x_next, hx.detach(), s_prev, g, level, k))
                    local = B.gamma_term(x_prev, s_prev, g, level) + B.rest_term(xk, hx, g, level)
                else:
                    x_prev = s_prev = None
                    local = B.first_step(xk, hx, level)
                if not torch.equal(local.detach(), x_next):
                    raise RuntimeError(f"BDIA block {k}: recomputed x_{k + 1} differs from the forward's; h_{k} is "
                                       "not deterministic (RNG not replayed, or a nondeterministic kernel)")
                outs, gouts = [local], [a_next]
                if k + 1 <= K - 1:  # block k+1 also reads x_k through its γ-term
                    outs.append(B.gamma_term(xk, s_k, B.per_sample(gammas[k], x), level))
                    gouts.append(a_next2)
                trainable = [q for q in params[k] if q.requires_grad]  # frozen parameters get no gradient
                got = iter(torch.autograd.grad(outs, [xk, *trainable], gouts, allow_unused=True))
                a_k = next(got)
                param_grads[k] = [next(got) if q.requires_grad else None for q in params[k]]
                a_next2, a_next = a_next, a_k
                x_next, x, s_k = x, x_prev, s_prev
        flat = [g for pg in param_grads for g in pg]
        return (a_next, None, None, None, None, None, None, *flat)


class BDIAStack(torch.nn.Module):
    """K residual branches h_k run as a BDIA stack (eqs. 18–21 in training, eq. 25 in eval).

    ``online=True`` trains with :class:`BDIAStackFunction` (activations are reconstructed, not stored);
    ``online=False`` runs the same quantised forward through ordinary autograd. γ per sample per block is
    drawn from ``seed`` (a new seed each call, from ``torch.randint`` on the global generator, when None).
    Weight tying across blocks is allowed but then parameter gradients are sums in a different order
    (equal to rounding, not bitwise).

    ``level=None`` with ``online=False`` is the unquantised BDIA of eq. 10 (eval: eq. 11), for ablations
    with Table 3's γ sets, e.g. ``gammas=(0.25, -0.25)``; it is not reversible, so it cannot run online.
    """

    def __init__(self, blocks, level: int | None = 9, online: bool = True, preserve_rng: bool = True,
                 use_triton: bool | None = None, gammas: tuple[float, ...] = B.GAMMAS):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.level, self.online, self.preserve_rng, self.use_triton = level, online, preserve_rng, use_triton
        self.gammas = tuple(float(g) for g in gammas)
        if level is not None:
            if isinstance(level, bool) or not isinstance(level, numbers.Integral):
                raise TypeError(f"level must be an integer l (the grid 2^-l) or None, got {level!r}")
            self.level = int(level)
        if not self.gammas:
            raise ValueError("gammas must hold at least one value")
        if len(self.blocks) < 2:
            raise ValueError("a BDIA stack needs at least 2 blocks")
        if online and level is None:
            raise ValueError(f"online back-propagation needs exact reversibility: a level l and γ ∈ {B.GAMMAS} "
                             f"(got l={level}, γ ∈ {self.gammas}); use online=False for this ablation")
        if level is not None and not set(self.gammas) <= set(B.GAMMAS):
            raise ValueError(f"quantised BDIA (eq. 21, level l) is defined for γ ∈ {B.GAMMAS} only, got γ ∈ "
                             f"{self.gammas}; Table 3's γ sets run unquantised: level=None, online=False")

    def forward(self, x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        if self.level is None:
            return self._plain(x, seed)
        if not self.training:
            x = B.quantize(x, self.level)
            x = B.first_step(x, self.blocks[0](x), self.level)
            for blk in self.blocks[1:]:
                x = B.inference_step(x, blk(x), self.level)
            return x
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        if not self.online:
            gammas = B.draw_gammas(seed, len(self.blocks), x.shape[0], self.gammas).to(x.dtype)
            return bdia_reference(self.blocks, x, gammas, self.level)
        triton_path = x.is_cuda if self.use_triton is None else self.use_triton
        params = [p for b in self.blocks for p in b.parameters()]
        return BDIAStackFunction.apply(x, list(self.blocks), seed, self.level, self.preserve_rng, triton_path,
                                       self.gammas, *params)

    def _plain(self, x, seed):
        """Eqs. 6 and 10 (training, γ from ``self.gammas``) or eq. 11 (eval), through ordinary autograd."""
        if not self.training:
            for blk in self.blocks:
                x = x + blk(x)
            return x
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        return B.run(self.blocks, x, B.draw_gammas(seed, len(self.blocks), x.shape[0], self.gammas).to(x.dtype))[0][-1]

    def extra_repr(self) -> str:
        return f"K={len(self.blocks)}, l={self.level}, online={self.online}, γ ∈ {self.gammas}"
