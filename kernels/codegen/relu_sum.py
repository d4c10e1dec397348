"""The ReLU-sum module of a table: forward y = h(x) with k-bit codes packed in rows of 8, backward dx = dy ·
LEVELS[code] (Approx-BP eq. 13), codes compared in float32 with 16-bit inputs' thresholds rounded to their grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.families import register

from ..ops.packing import storage_bits
from .helpers import import_helpers
from .printer import (
    by_storage_dtype,
    round_down,
    triton_source,
)
from .registry import RENDERERS
from .twins import (
    ACTIVATION_TEMPLATE,
    HEADER_TEMPLATE,
    activation_twin,
    identity,
    relative_path,
    twins_section,
)

__all__ = ["render_relu_sum"]


_RELU_SUM_TEMPLATE = HEADER_TEMPLATE + '''\
BITS = {bits}
STORAGE_BITS = {storage}
KNOTS = {knots!r}
LEVELS = {levels!r}
''' + ACTIVATION_TEMPLATE + '''

@triton.jit
def _nan_max(a, b):
    # cast back: Triton 3.6 takes a 16-bit maximum in fp32, and a reduction's combine must keep its element type
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL).to(a.dtype)


{code_fn}@triton.jit
def packed_codes(x, lane, knots_ptr, DT: tl.constexpr):
    # the row's {per_row} codes packed little-end-first into one {row_bits}-bit integer (code j at bits {storage}·j);
    # x is the input in fp32, DT its storage dtype: for 16-bit data each knot is rounded down to that dtype, which
    # leaves every code unchanged (x ≤ c ⇔ x ≤ rd(c) for x in DT) and lets compares run on packed pairs
{pack_body}


@triton.jit
def level_of(code, levels_ptr):
{level_body}


@triton.jit
def forward_kernel(x_ptr, y_ptr, packed_ptr, knots_ptr, nan_ptr, n_elem, n_rows, ROWS: tl.constexpr):
    # a program covers ROWS rows of 8 elements; each thread packs its own row's codes into one {row_bits}-bit integer
    # (the same bytes as packing byte by byte), and writes one byte nan_ptr[program] = [a NaN among them]
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    lane = tl.arange(0, 8)
    offs = row[:, None] * 8 + lane[None, :]
    inside = offs < n_elem
    raw = tl.load(x_ptr + offs, mask=inside, other=float("-inf"))  # padding lanes get code 0
    x = raw
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    y = activation(x, x_ptr.dtype.element_ty.primitive_bitwidth <= 16)
    if y_ptr.dtype.element_ty.primitive_bitwidth < y.dtype.primitive_bitwidth:
        y = y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(y_ptr + offs, y, mask=inside)
    xf = x.to(tl.float32)  # codes compare in fp32
    packed = packed_codes(xf, lane, knots_ptr, x_ptr.dtype.element_ty)
    tl.store(packed_ptr.to(tl.pointer_type(tl.{row_type})) + row, packed, mask=row < n_rows)
    nan_max = tl.reduce(raw, None, _nan_max)  # NaN iff a NaN is among them (on the stored dtype: packed pairs)
    tl.store(nan_ptr + tl.program_id(0), (nan_max != nan_max).to(tl.uint8))


@triton.jit
def backward_kernel(grad_ptr, packed_ptr, levels_ptr, nan_ptr, out_ptr, n_elem, n_rows, ROWS: tl.constexpr):
    # ROWS must be the forward's: program p reads the NaN byte its forward twin wrote
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    lane = tl.arange(0, 8)
    offs = row[:, None] * 8 + lane[None, :]
    inside = offs < n_elem
    packed = tl.load(packed_ptr.to(tl.pointer_type(tl.{row_type})) + row, mask=row < n_rows, other=0)
    code = ((packed[:, None] >> (lane[None, :] * {storage})) & {mask}).to(tl.int32)
    g = tl.load(grad_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    dx = tl.where(tl.load(nan_ptr + tl.program_id(0)) != 0, float("nan"), g * level_of(code, levels_ptr))
    if out_ptr.dtype.element_ty.primitive_bitwidth < 32:
        dx = dx.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + offs, dx, mask=inside)
'''


#: The integer type of one row of 8 packed codes, by storage bits.
_ROW_TYPES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

#: Up to this k, knots are compile-time comparisons and levels compile-time selects (2^k − 1 of each per
#: element); above it the kernels read them from a small table (a k-step binary search, one gather).
_UNROLL_BITS = 4


def _f32(v: float) -> str:
    """A constant as the float32 value the kernels and the twin use (exact in either precision)."""
    return repr(float(np.float32(v)))


def _code_fn(bits: int) -> str:
    """Above UNROLL_BITS: ``code_of``, a k-step binary search over the knots read from a small table (k ≤ UNROLL_BITS
    packs without forming codes, :func:`_codes_for`)."""
    if bits <= _UNROLL_BITS:
        return ""
    return "\n".join(["@triton.jit",
                      "def code_of(x, knots_ptr):",
                      "    # code = #{i : c_i < x} (left-continuous; NaN → top code, as torch.bucketize)",
                      "    code = tl.zeros(x.shape, dtype=tl.int32)",
                      f"    for s in tl.static_range({bits}):",
                      f"        probe = code + (1 << ({bits} - 1 - s))",
                      "        code = tl.where(x <= tl.load(knots_ptr + probe - 1), code, probe)",
                      "    return code", "", "", ""])


def _wide(storage: int) -> str:
    """8-bit codes of a row of 8 fill 64 bits: their place values are int64."""
    return ".to(tl.int64)" if storage == 8 else ""


def _tagged(t: float, tag: int, dtype: torch.dtype) -> float:
    """A float32 threshold that compares like ``t`` against every value of the 16-bit ``dtype`` (x ≤ result ⇔ x ≤ t)
    and carries ``tag`` in its low mantissa bits, which 16-bit values never reach: a value of [t, next value of
    dtype above t). For t < 0 that is −(m′ | tag) with m′ the magnitude of the next value up."""
    if tag == 0:
        return t
    t16 = torch.tensor(t, dtype=dtype)
    up = float(torch.nextafter(t16, torch.tensor(float("inf"), dtype=dtype)))
    base = 0.0 if t == 0 else (t if t > 0 else up)
    bits = lambda v: int(np.float32(abs(v)).view(np.uint32))  # noqa: E731
    tagged = float(np.uint32(bits(base) | tag).view(np.float32)) * (1.0 if t >= 0 else -1.0)
    if not (t <= tagged < up and bits(tagged) & tag == tag):
        raise AssertionError(f"cannot tag the threshold {t!r} of {dtype} with {tag}")
    return tagged


def _codes_for(knots: list[float], bits: int, storage: int, indent: str, dtype: torch.dtype | None) -> list[str]:
    """Lines that leave the packed row in ``word``. k ≤ 2: every knot adds the lane's place value where c_i < x (the
    shift is a per-register constant, so no code is formed). k = 3, 4: a binary search whose thresholds are
    compile-time selects on the bits found so far (k compares and 2^k − 1 − k selects instead of 2^k − 1
    compares). For 16-bit data (``dtype``) the last step's threshold carries its leaf's code in its low mantissa
    bits (:func:`_tagged`), so the code is those bits plus the last compare instead of k selects and adds. NaN fails
    every x ≤ c and gets the top code, as torch.bucketize."""
    wide = _wide(storage)
    place = f"(lane * {storage})[None, :]"
    if bits <= 2:
        return [f"{indent}one = (1{wide} << {place})",
                *[f"{indent}word {'=' if i == 0 else '+='} tl.where(x <= {c!r}, 0, one)" for i, c in enumerate(knots)]]
    last = bits - 1

    def threshold(step: int, j: int, prefix: int) -> str:  # knots[prefix + 2^(k−1−step) − 1], selected on bits < step
        if j == step:
            c = knots[prefix + (1 << (bits - 1 - step)) - 1]
            return repr(_tagged(c, prefix, dtype) if dtype is not None and step == last else c)
        hi = threshold(step, j + 1, prefix + (1 << (bits - 1 - j)))
        return f"tl.where(le{j}, {threshold(step, j + 1, prefix)}, {hi})"

    lines = []
    for step in range(bits if dtype is None else last):
        lines.append(f"{indent}le{step} = x <= {threshold(step, 0, 0)}")
        bit = f"({1 << (bits - 1 - step)}{wide} << {place})"
        if dtype is None:
            lines.append(f"{indent}word {'=' if step == 0 else '+='} tl.where(le{step}, 0, {bit})")
    if dtype is not None:
        lines += [f"{indent}t = {threshold(last, 0, 0)}  # tagged with its leaf's code",
                  f"{indent}code = (t.to(tl.int32, bitcast=True) & {(1 << bits) - 2}) | tl.where(x <= t, 0, 1)",
                  f"{indent}word = code{wide} << {place}"]
    return lines


def _pack_body(knots: list[float], bits: int, storage: int) -> str:
    """Σ_j code_j·2^(storage·j) over the row (:func:`_codes_for`; above UNROLL_BITS the searched codes shift)."""
    if bits > _UNROLL_BITS:
        return f"    return tl.sum(code_of(x, knots_ptr){_wide(storage)} << (lane[None, :] * {storage}), axis=1)"
    as_f32 = [float(np.float32(c)) for c in knots]
    lines = by_storage_dtype("DT", lambda dt: _codes_for([round_down(c, dt) for c in as_f32] if dt else as_f32,
                                                          bits, storage, " " * 8, dt), "    ")
    return "\n".join([*lines, "    return tl.sum(word, axis=1)"])


def _level_body(levels: list[float], bits: int) -> str:
    if bits <= _UNROLL_BITS:
        lines = [f"    level = tl.full(code.shape, {_f32(levels[0])}, tl.float32)"]
        lines += [f"    level = tl.where(code == {j}, {_f32(v)}, level)" for j, v in enumerate(levels) if j]
        return "\n".join([*lines, "    return level"])
    return "    return tl.load(levels_ptr + code)"


def render_relu_sum(table_path: Path, t: dict | None = None) -> str:
    t = t or table_files.load(table_path)
    if t.family != "relu-sum":
        raise ValueError(f"{table_path}: export handles relu-sum tables, got family {t.family!r}")
    act = get_activation(t.expression)
    storage = storage_bits(t.bits)
    doc = (f"{t.activation} with the k={t.bits} ReLU-sum derivative ({t.objective} objective): forward is "
           f"the exact activation plus one packed {storage}-bit code per element; backward is grad × LEVELS[code].\n"
           f"Table: {relative_path(table_path)} (definition sha256 {table_files.definition_sha256(t)}).")
    source = triton_source(act.expr, lowp=True)
    return _RELU_SUM_TEMPLATE.format(
        docstring=repr(doc), **identity(table_path, t),
        bits=t.bits, storage=storage, per_row=8, row_bits=8 * storage, row_type=_ROW_TYPES[storage],
        mask=(1 << storage) - 1, knots=tuple(t.knots), levels=tuple(t.levels), helpers=import_helpers(source),
        source=source, code_fn=_code_fn(t.bits),
        pack_body=_pack_body(t.knots, t.bits, storage), level_body=_level_body(t.levels, t.bits)
    ) + twins_section(activation_twin(act, 0, "activation_twin"))


register(RENDERERS, "relu-sum", render_relu_sum)
