"""The InvAct module of a table: forward y = f(x) and one branch bit per element (none for a monotone table),
backward dx = dy · q_s(y) (Inverted Activations §2)."""

from __future__ import annotations

from pathlib import Path

import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.families import register
from approxbp.approximations.invact_forms import RULE_PARTS, backward_rule

from .helpers import import_helpers
from .printer import (
    TritonPrinter,
    by_storage_dtype,
    lower,
    round_up,
    triton_source,
)
from .registry import RENDERERS
from .twins import (
    ACTIVATION_TEMPLATE,
    HEADER_TEMPLATE,
    activation_twin,
    form_twin,
    identity,
    relative_path,
    twin_def,
    twins_section,
)

__all__ = ["render_invact"]


_INVACT_HEAD = HEADER_TEMPLATE + '''\
{monotone}TURNING_POINT = {T!r}
F_T = {f_T!r}
LEFT_MAX = {left_max!r}
RIGHT_MAX = {right_max!r}
''' + ACTIVATION_TEMPLATE + '''

@triton.jit
def activation_grad(x):
    # h′, used beyond the fitted right domain (y > RIGHT_MAX), where f⁻¹(y) = y to within h's tail
    return {grad_source}
{left}

@triton.jit
def q_right(y):
{right}
{combined}
'''
#: A monotone table's kernels: y = f(x) and nothing else saved; backward reads y alone (one branch, no bit).
_MONOTONE_KERNELS = '''
@triton.jit
def forward_kernel(x_ptr, y_ptr, n_elem, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_elem
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    y = activation(x, x_ptr.dtype.element_ty.primitive_bitwidth <= 16)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


@triton.jit
def backward_kernel(grad_ptr, y_ptr, out_ptr, n_elem, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_elem
    y = tl.load(y_ptr + offs, mask=inside, other=0.0)
    if y.dtype != tl.float64:
        y = y.to(tl.float32)
    q = {rule}  # approximations.invact_forms.backward_rule
    g = tl.load(grad_ptr + offs, mask=inside, other=0.0)
    if g.dtype != tl.float64:
        g = g.to(tl.float32)
    tl.store(out_ptr + offs, (g * q).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
'''
_INVACT_KERNELS = '''
@triton.jit
def forward_kernel(x_ptr, y_ptr, packed_ptr, n_elem, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    offs = byte[:, None] * 8 + lane[None, :]
    inside = offs < n_elem
    x = tl.load(x_ptr + offs, mask=inside, other=float("inf"))  # padding lanes: bit 0
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    y = activation(x, x_ptr.dtype.element_ty.primitive_bitwidth <= 16)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
    # s = [x < T]; for 16-bit data against T rounded up to that dtype (the same bit, compared on packed pairs)
{left_body}
    word = tl.sum(tl.where(left, 1 << lane[None, :], 0), axis=1)  # the shift is a per-register constant
    tl.store(packed_ptr + byte, word.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def backward_kernel(grad_ptr, y_ptr, packed_ptr, out_ptr, n_elem, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    offs = byte[:, None] * 8 + lane[None, :]
    inside = offs < n_elem
    word = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    left = ((word[:, None] >> lane[None, :]) & 1) == 1
    y = tl.load(y_ptr + offs, mask=inside, other=0.0)
    if y.dtype != tl.float64:
        y = y.to(tl.float32)
    b = tl.where(left, 1.0, 0.0)
    q = {rule}  # approximations.invact_forms.backward_rule
    g = tl.load(grad_ptr + offs, mask=inside, other=0.0)
    if g.dtype != tl.float64:
        g = g.to(tl.float32)
    tl.store(out_ptr + offs, (g * q).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
'''


def _jit_body(branch: dict, variables: tuple[str, ...] = ("y",)) -> str:
    """A q(y) body: each table assignment (coefficients in place) becomes a local, then the return."""
    from approxbp.approximations.invact_forms import Form

    form = Form.from_table(branch, variables)
    printer = TritonPrinter()
    code = lambda e: printer.doprint(lower(e.xreplace(form.values)).evalf(17))  # noqa: E731
    lines = [f"    {name} = {code(value)}" for name, value in form.assignments]
    return "\n".join([*lines, f"    return {code(form.expression)}"])


def render_invact(table_path: Path, t: dict | None = None) -> str:
    t = t or table_files.load(table_path)
    if t.family != "invact":
        raise ValueError(f"{table_path}: expected an invact table, got family {t.family!r}")
    act = get_activation(t.expression)
    saved = ("nothing but y (increasing: one branch, no bit); backward is grad × q(y)" if t.monotone else
             "one packed branch bit s = [x < T] per element (8 per byte); backward is grad × q_s(y)")
    doc = (f"{t.activation} inverted activation ({t.form} form): forward is the exact activation plus {saved} from "
           f"the saved output y.\nTable: {relative_path(table_path)} "
           f"(definition sha256 {table_files.definition_sha256(t)}).")
    code = {"source": triton_source(act.expr, lowp=True), "grad_source": triton_source(act.derivative_expr(1)),
            "left": "" if t.monotone else f"\n\n@triton.jit\ndef q_left(y):\n{_jit_body(t.left)}\n",
            "right": _jit_body(t.right),
            "combined": (f"\n\n@triton.jit\ndef q_combined(y, b):\n{_jit_body(t.combined, ('y', 'b'))}\n"
                         if t.combined is not None else ""),
            "rule": TritonPrinter().doprint(backward_rule(t))}
    left_body = "" if t.monotone else "\n".join(by_storage_dtype("x_ptr.dtype.element_ty", lambda dt: [
        f"        left = x < {(round_up(t.turning_point, dt) if dt else t.turning_point)!r}"], "    "))
    template = _INVACT_HEAD + (_MONOTONE_KERNELS if t.monotone else _INVACT_KERNELS)
    return template.format(
        docstring=repr(doc), **identity(table_path, t), monotone="MONOTONE = True\n" if t.monotone else "",
        T=t.turning_point, f_T=t.f_T,
        left_max=None if t.monotone else t.left.domain[1], left_body=left_body, right_max=t.right.domain[1],
        helpers=import_helpers(*code.values()), **code) + _invact_twins(t, act)


def _invact_twins(t, act) -> str:
    """h, h′, the branch forms and the backward rule (approximations.invact_forms.backward_rule) for torch."""
    defs = [activation_twin(act, 0, "activation_twin"), activation_twin(act, 1, "activation_grad_twin"),
            *([] if t.monotone else [form_twin(t.left, "q_left_twin")]), form_twin(t.right, "q_right_twin")]
    if t.combined is not None:
        defs.append(form_twin(t.combined, "q_combined_twin", ("y", "b")))
    rule = backward_rule(t)
    for part in RULE_PARTS:
        rule = rule.replace(sp.Function(part), sp.Function(f"{part}_twin"))
    defs.append(twin_def("backward_rule_twin", list(sp.symbols("y b")), [], rule))
    return twins_section(*defs)


register(RENDERERS, "invact", render_invact)
