"""ReLU-sum activations for training: exact forward, k-bit saved codes, table-driven backward.

CUDA tensors (or any tensor with ``use_triton=True``, e.g. on the CPU under ``TRITON_INTERPRET=1``)
run the generated Triton kernels; other tensors run the pure-PyTorch twin below, which is also the
test oracle. Both compute in float32 (float64 input: float64) and store the output in the input's dtype; codes
always compare in float32.

Layout of the saved codes: codes are packed consecutively, little-end-first, into bytes (s = storage bits), so a
row of 8 elements is one 8s-bit little-endian integer: each GPU thread packs whole rows in registers. The buffer
is padded to whole rows and whole 4-byte words (:func:`pack` is the same bytes).

NaN: the k-bit codes have no room for "not a number", so the forward also saves one byte per block of
``nan_span`` = 4096 elements (+0.02 % memory at k = 2) saying whether the block held a NaN; the backward
returns NaN for every element of such a block (torch returns it for the NaN element only; the loss is NaN
either way). ±inf get the outermost levels, the ReLU-sum's own derivative there.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import triton
from approxbp.approximations import tables as table_files
from approxbp.kernels.ops.torch_private import unset_fake_temporarily
from torch import Tensor

from . import custom_ops
from .guards import check_input, check_triton_device
from .launch import RELU_SUM_ROWS, RELU_SUM_SPAN, num_warps
from .modules import GeneratedSpec, spec_of
from .packing import byte_codes, pack, unpack_into

__all__ = ["dispatch", "ReGELU2", "RELU_SUM", "relu_sum", "relu_sum_forward", "ReLUSumActivation", "ReLUSumFunction",
           "ReLUSumSpec", "ReSiLU2"]


class ReLUSumSpec(GeneratedSpec):
    """Everything one table needs at run time, read from its generated module (knots, levels, bits, the Triton
    kernels and the PyTorch twin; the module was generated from the validated table whose definition hash the
    file still has). Built once per module; the custom ops find it by ``key``."""

    family = "relu-sum"
    plan_options = {f"relu-sum-k{k}": k for k in (1, 2, 3, 4)}  # the packaged primitive fits the planner weighs

    @staticmethod
    def packaged(activation: str, bits: int) -> str:
        return f"relu_sum/{table_files.relu_sum_name(activation, bits, 'primitive')}"

    def error_said(self) -> str:
        """The levels against the derivative of the generated twin of f (torch autograd in float64)."""
        from approxbp.approximations.gradient_error import describe, relu_sum_error

        def df(x):  # real tensors, with grad, whatever the caller's mode (the planner's fake tensors)
            with unset_fake_temporarily(), torch.enable_grad():
                v = torch.tensor(x, dtype=torch.float64, requires_grad=True)
                return torch.autograd.grad(self.module.activation_twin(v).sum(), v)[0].numpy()
        return describe(self.family, relu_sum_error(self.module.KNOTS, self.module.LEVELS, df))

    def __init__(self, table: str | Path | dict, kernels_dir: str | Path | None = None):
        super().__init__(table, kernels_dir)
        m = self.module
        self.bits, self.storage = m.BITS, m.STORAGE_BITS
        with unset_fake_temporarily():  # real constants even when built for a fake-tensor plan (specs are shared)
            self.knots64 = torch.tensor(m.KNOTS, dtype=torch.float64)
            self.levels64 = torch.tensor(m.LEVELS, dtype=torch.float64)
        self._dev: dict = {}

    def consts(self, device):
        """Knots and levels as float32 on ``device`` (codes compare in float32, as the kernel does), and the
        levels of every code in each byte value ([256, 8/storage], for the twin's one-gather unpacking)."""
        if device not in self._dev:
            with unset_fake_temporarily():  # cached: never a fake tensor
                levels = self.levels64.to(device, torch.float32)
                self._dev[device] = (self.knots64.to(device, torch.float32), levels,
                                     levels[byte_codes(self.storage, device).clamp_max(len(levels) - 1)])
        return self._dev[device]

    nan_span = RELU_SUM_SPAN  # elements per forward program, and per saved NaN byte

    def packed_bytes(self, numel: int) -> int:
        """Bytes of the saved codes: whole rows of 8 codes (``storage`` bytes each), padded to whole 4-byte
        words."""
        row_bytes = max(4, self.storage)  # lcm(4, storage)
        return row_bytes * math.ceil(numel * self.storage / (8 * row_bytes))

    # -- the pure-PyTorch twin -------------------------------------------------------------
    def forward_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        knots = self.consts(x.device)[0]
        y = self.forward_only_torch(x)  # fp32 math; fp64 stays
        codes = torch.bucketize(x.float().contiguous(), knots, out_int32=True)  # #{c_i < x} in fp32; NaN → top
        nan = torch.isnan(x.reshape(-1))
        nan = torch.nn.functional.pad(nan, (0, (-nan.numel()) % self.nan_span)).view(-1, self.nan_span).any(1)
        return y, pack(codes, self.storage, self.packed_bytes(x.numel())), nan.view(torch.uint8)

    def backward_torch(self, g: torch.Tensor, packed: torch.Tensor, nan: torch.Tensor, numel: int) -> torch.Tensor:
        dx = g.float() * unpack_into(packed, self.consts(g.device)[2], numel).view(g.shape)
        block_nan = nan.view(torch.bool)[:, None].expand(-1, self.nan_span).reshape(-1)[:numel].view(g.shape)
        return torch.where(block_nan, float("nan"), dx).to(g.dtype)

    # -- the Triton kernels --------------------------------------------------------------------
    def _rows_grid(self, packed: torch.Tensor) -> tuple[int, tuple[int]]:
        """Rows of 8 codes (``storage`` bytes each) in the packed buffer, and the grid over them: the forward's and
        the backward's must agree, since program p's NaN byte covers its rows."""
        rows = packed.numel() // self.storage
        return rows, (triton.cdiv(rows, RELU_SUM_ROWS),)

    def forward_triton(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_triton_device(x)
        knots = self.consts(x.device)[0]
        xc = x.contiguous()
        y = torch.empty_like(xc)
        n = xc.numel()
        packed = torch.empty(self.packed_bytes(n), dtype=torch.uint8, device=x.device)
        rows, grid = self._rows_grid(packed)
        nan = torch.empty(grid[0], dtype=torch.uint8, device=x.device)
        if n:
            self.module.forward_kernel[grid](xc, y, packed, knots, nan, n, rows, ROWS=RELU_SUM_ROWS,
                                             num_warps=num_warps(x.dtype))
        return y, packed, nan

    def backward_triton(self, g: torch.Tensor, packed: torch.Tensor, nan: torch.Tensor, numel: int) -> torch.Tensor:
        levels = self.consts(g.device)[1]
        gc = g.contiguous()
        out = torch.empty_like(gc)
        if numel:
            rows, grid = self._rows_grid(packed)
            self.module.backward_kernel[grid](gc, packed, levels, nan, out, numel, rows, ROWS=RELU_SUM_ROWS,
                                              num_warps=num_warps(g.dtype))
        return out


# ---- the op (custom_ops.Op): custom ops under dynamo, an eager Function otherwise ---------------------------------
def _forward(x: Tensor, key: str, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """y = h(x), the packed k-bit codes and one NaN byte per block."""
    spec = spec_of(key)
    y, packed, nan = (spec.forward_triton if use_triton else spec.forward_torch)(x)
    return custom_ops.laid_out_like(y.view(x.shape), x), packed, nan


def _backward(g: Tensor, packed: Tensor, nan: Tensor, key: str, use_triton: bool) -> Tensor:
    """dx = dy · LEVELS[code] (NaN for each element of a block that held a NaN)."""
    spec = spec_of(key)
    backward = spec.backward_triton if use_triton else spec.backward_torch
    return custom_ops.laid_out_like(backward(g, packed, nan, g.numel()).view(g.shape), g)


def _forward_fake(x, key, use_triton):
    spec, n = spec_of(key), x.numel()
    return (torch.empty_like(x), x.new_empty((spec.packed_bytes(n),), dtype=torch.uint8),
            x.new_empty(((n + spec.nan_span - 1) // spec.nan_span,), dtype=torch.uint8))


RELU_SUM = custom_ops.Op("relu_sum", _forward, _backward, saves=lambda inputs, out: out[1:],
                         options=lambda x, key, use_triton: (key, use_triton),
                         fakes=(_forward_fake, lambda g, packed, nan, key, use_triton: torch.empty_like(g)),
                         function_name="ReLUSumFunction")
relu_sum_forward, ReLUSumFunction = RELU_SUM.forward_op, RELU_SUM.function


def dispatch(x: Tensor, spec: ReLUSumSpec, use_triton: bool) -> Tensor:
    """y = h(x); saves the packed codes and NaN bytes (:data:`RELU_SUM`); without grad, the twin's plain forward."""
    if not (use_triton or custom_ops.needs_grad(x) or custom_ops.opaque()):
        return spec.forward_only_torch(x)
    return RELU_SUM(x, spec.key, use_triton)[0]


def relu_sum(x: torch.Tensor, spec: ReLUSumSpec, use_triton: bool | None = None) -> torch.Tensor:
    """y = h(x) exactly; saves the packed k-bit codes (and a NaN byte per block); dx = dy · LEVELS[code]
    (:func:`dispatch` on a checked input; ``use_triton`` None: on CUDA tensors)."""
    check_input(x, "ReLUSumActivation")
    return dispatch(x, spec, x.is_cuda if use_triton is None else use_triton)


class ReLUSumActivation(torch.nn.Module):
    """Drop-in activation whose backward uses a ReLU-sum table (any activation, any k)."""

    def __init__(self, table: str | Path | dict, use_triton: bool | None = None,
                 kernels_dir: str | Path | None = None):
        """``kernels_dir``: where the generated Triton module lives (``approxbp export --out-dir``); None: the
        package for packaged tables, ``<table folder>/_generated/`` for yours."""
        super().__init__()
        self.spec = custom_ops.checked_and_registered(ReLUSumSpec(table, kernels_dir), use_triton)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_sum(x, self.spec, self.use_triton)

    def extra_repr(self) -> str:
        return f"table={self.spec.name()}, saved bits/element={self.spec.storage}"


class ReGELU2(ReLUSumActivation):
    """GELU forward, 2-bit ReLU-sum backward (Approx-BP §4.2). ``paper=True`` uses the printed coefficients."""

    def __init__(self, paper: bool = False, use_triton: bool | None = None):
        super().__init__(table_files.relu_sum_name("gelu", 2, "primitive", "paper" if paper else "fit"), use_triton)


class ReSiLU2(ReLUSumActivation):
    """SiLU forward, 2-bit ReLU-sum backward (Approx-BP §4.2). ``paper=True`` uses the printed coefficients."""

    def __init__(self, paper: bool = False, use_triton: bool | None = None):
        super().__init__(table_files.relu_sum_name("silu", 2, "primitive", "paper" if paper else "fit"), use_triton)


ReLUSumSpec.drop_in = ReLUSumActivation
