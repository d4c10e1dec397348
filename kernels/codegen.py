"""Generate Triton modules from coefficient tables (``approxbp export``).

A small sympy→Triton printer lowers the activation's expression to operations that run both compiled
and under ``TRITON_INTERPRET=1`` (``tl.math.erf``, ``tl.exp``, ``tl.log``, ``tl.sqrt``): ``tanh`` and
``log(1 + exp(u))`` become overflow-safe exp/log forms, constants keep full float64 digits. Compiled float32
code divides by one MUFU.RCP (``_rcp``; Triton's ``/`` is div.full.f32, 9 SASS instructions), takes a clamped
log by MUFU.LG2 (``_log``), and for 16-bit data evaluates Φ without erf (``_phi``).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from functools import cache
from pathlib import Path

import numpy as np
import sympy as sp
import torch
from approxbp.approximations import backends, get_activation
from approxbp.approximations import tables as T
from approxbp.approximations.activations import select, softplus, stable_form
from approxbp.approximations.activations import x as activation_x
from approxbp.approximations.elementary import LN2, LOG2E, PHI_TAIL_P, phi_tail
from approxbp.approximations.files import write_atomic
from approxbp.approximations.invact_forms import RULE_PARTS, backward_rule
from sympy.printing.pycode import PythonCodePrinter

from .glu import GLU_ACTIVATIONS, glu_module_name
from .modules import FORMAT, module_path
from .packing import storage_bits

_rcp = sp.Function("_rcp")  # 1/u (helpers: one MUFU.RCP in compiled float32)
_rsqrt = sp.Function("_rsqrt")  # 1/√u


class TritonPrinter(PythonCodePrinter):
    """Prints a sympy expression in ``x`` as a Triton (tl.*) expression. ``lowp``: Φ prints as ``_phi(u, LOWP)``
    (the enclosing jit function has a ``LOWP`` constexpr: 16-bit data)."""

    def __init__(self, lowp: bool = False):
        super().__init__()
        self.lowp = lowp

    def doprint(self, expr, *args, **kwargs):  # every expression printed gets the helpers' reciprocals
        return super().doprint(reciprocals(expr), *args, **kwargs)

    def _print_Float(self, e):
        return repr(float(e))

    def _print_Rational(self, e):
        return repr(float(e))

    def _print_Integer(self, e):
        return repr(float(e))

    def _print_NumberSymbol(self, e):
        return repr(float(e))

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def _print_Pow(self, e, rational=False):
        base, exp = e.args
        if exp.is_Float and float(2 * exp).is_integer():  # evalf turns √ into **0.5
            exp = sp.Rational(int(2 * exp), 2)
        if exp == sp.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exp.is_Rational and exp.q == 2 and 0 < exp < 4:  # b^{n+1/2} = b^n·√b
            return " * ".join([f"tl.sqrt({self._print(base)})"] + [self.parenthesize(base, 100)] * int(exp))
        if exp.is_Integer and 1 < int(exp) <= 4:
            return "(" + " * ".join([self.parenthesize(base, 100)] * int(exp)) + ")"
        return f"tl.exp({self._print(exp)} * tl.log({self._print(base)}))"  # negative powers: see reciprocals()

    def _fn(self, name, e):
        return f"{name}({', '.join(self._print(a) for a in e.args)})"

    def _print(self, expr, **kwargs):
        """Function applications print by their Triton form in the function set (approximations.backends); one
        without a form is refused, never printed as ``math.<name>(…)`` (which fails at the first launch)."""
        if not getattr(expr, "is_Function", False):
            return super()._print(expr, **kwargs)
        fn = backends.FUNCTIONS.get(type(expr).__name__)
        if fn is None:
            return self._print_Function(expr)
        if fn.triton is None:
            return self._refuse(expr)
        if callable(fn.triton):
            return fn.triton(self, expr)
        return fn.triton.format(*(self._print(a) for a in expr.args))

    def _print_Function(self, e):
        name = type(e).__name__
        if name in RULE_PARTS:  # the module's own jit functions
            return self._fn(name, e)
        if name in ("_rcp", "_rsqrt"):
            return self._fn({"_rsqrt": "tl.math.rsqrt"}.get(name, name), e)
        return self._refuse(e)

    def _refuse(self, e, *args, **kwargs):
        raise ValueError(f"cannot lower {type(e).__name__} to Triton (export refuses it); supported: "
                         f"{', '.join(f.name for f in backends.functions(triton=True))} and powers")


def lower(expr: sp.Expr) -> sp.Expr:
    """The shared stable form (approximations.activations.stable_form), then Mish's tanh(softplus(u)) → n/(n + 2)
    with n = e^u(e^u + 2) (the same function: one exp and one division instead of exp, log, exp and two divisions;
    no cancellation as u → −∞; 1 for u > 20, where it rounds to 1 and e^{2u} would overflow)."""
    u = sp.Wild("u")

    def tanh_softplus(u):
        n = sp.exp(u) * (sp.exp(u) + 2)
        return select(u - 20, sp.Integer(1), n / (n + 2))

    return stable_form(expr).replace(sp.tanh(softplus(u)), tanh_softplus)


def reciprocals(expr: sp.Expr) -> sp.Expr:
    """Negative powers as the helpers' reciprocals: b^−n → _rcp(bⁿ) (n = 1 … 4), b^−½ → _rsqrt(b) (exponents may be
    floats after evalf); other negative powers stay exp(p·log b). TritonPrinter.doprint applies it."""
    def fast(e):
        p = float(e.exp)
        if p == -0.5:
            return _rsqrt(e.base)
        if p.is_integer() and -4 <= p <= -1:
            return _rcp(e.base ** int(-p))
        return e

    return expr.replace(lambda e: e.is_Pow and e.exp.is_number and float(e.exp) < 0, fast)


def triton_source(expr: sp.Expr, lowp: bool = False) -> str:
    """The Triton source of ``expr`` (a sympy expression in x); ``lowp``: Φ as the 16-bit-data ``_phi``. Every
    constant subexpression becomes one float64 literal, inside the function symbols too (which evalf leaves alone):
    ``sqrt(2/pi)`` in GELU-tanh's σ(…) would otherwise run as float32 ``tl.sqrt`` and ``rsqrt`` calls, off by 5e-8
    in float64."""
    return TritonPrinter(lowp).doprint(_fold_constants(lower(expr).evalf(17)))


def _fold_constants(expr: sp.Expr) -> sp.Expr:
    return expr.replace(lambda e: e.is_number and not e.is_Number, lambda e: e.evalf(17))


def _tanh_series(terms: int = 13) -> str:
    """Horner form of tanh's odd Taylor series z·Σ a_j z^{2j}, j < terms (relative error < 1e-17 at |z| = 0.3)."""
    z = sp.Symbol("z")
    poly = sp.Poly(sp.series(sp.tanh(z), z, 0, 2 * terms + 1).removeO() / z, z)
    return _horner(tuple(float(poly.coeff_monomial(z ** (2 * j))) for j in range(terms)), "z2")


def _horner(coeffs: tuple[float, ...], var: str) -> str:
    """c₀ + var·(c₁ + var·(…)) as Triton source, the coefficients printed by repr (exact float64)."""
    body = repr(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        body = f"{c!r} + {var} * ({body})"
    return body


HELPERS_TEMPLATE = '''
#: Compiled (not interpreted): the float32 primitives below are PTX approximations; the interpreter has no inline asm.
_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _rcp(v):
    # 1/v; compiled float32: rcp.approx.ftz.f32, one MUFU.RCP (≤ 1 ulp, PTX ISA; Triton's `/` is div.full.f32, 9 SASS
    # instructions); fp64 and the interpreter divide
    if v.dtype == tl.float32 and _COMPILED:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = 1.0 / v
    return r


@triton.jit
def _log(v):
    # log(v) for a clamped positive argument (the printer's clamped log); compiled float32: lg2.approx.ftz.f32 · ln 2,
    # one MUFU.LG2 (absolute error ≤ 2^-22.6 in log2, PTX ISA; libdevice's logf is 26 SASS instructions); NaN stays
    # NaN; fp64 and the interpreter use tl.log
    if v.dtype == tl.float32 and _COMPILED:
        r = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                      pack=1) * {ln2}
    else:
        r = tl.log(v)
    return r


@triton.jit
def _phi(u, LOWP: tl.constexpr):
    # Φ(u) = (1 + erf(u/√2))/2 (its left tail cancels, as F.gelu's does). LOWP (16-bit data): Φ(−|u|) =
    # t·2^(P(t) − u²·log2(e)/2), t = 1/(1 + p|u|) (approximations.elementary.phi_tail; relative error < 6e-6 in
    # float32, 1e-7 where |u| < 4, no cancellation): every bf16 GELU correctly rounded, 18 SASS instructions to erf's 30
    if LOWP:
        t = _rcp(1.0 + {phi_p} * tl.abs(u))
        q = t * tl.exp2({phi_poly} - u * u * {half_log2e})
        r = tl.where(u < 0.0, q, 1.0 - q)
    else:
        r = 0.5 * (1.0 + tl.math.erf(0.7071067811865476 * u))
    return r


@triton.jit
def _tanh(z):
    # |z| ≥ 0.3: sign(z)·(1 − e^{−2|z|})/(1 + e^{−2|z|}) (no overflow); |z| < 0.3: odd Taylor series to z^25
    # (accurate in float64 too)
    t = tl.exp(-2.0 * tl.abs(z))
    r = (1.0 - t) * _rcp(1.0 + t)
    z2 = z * z
    p = z * ({series})
    return tl.where(tl.abs(z) < 0.3, p, tl.where(z < 0.0, -r, r))


@triton.jit
def _softplus(z):
    # log(1 + e^z) = max(z, 0) + log1p(e^{−|z|}); log1p(t) = log(u)·t/(u − 1) with u = 1 + t (exact to
    # a few ulp, Goldberg's trick: it needs libdevice's relative accuracy of log near 1), = t when u rounds to 1
    t = tl.exp(-tl.abs(z))
    u = 1.0 + t
    return tl.maximum(z, 0.0) + tl.where(u == 1.0, t, tl.log(u) * (t * _rcp(u - 1.0)))
'''


@cache
def helpers_source() -> str:
    """The shared helpers' Triton code (the Φ-tail fit runs once, on first use: export time, not import time)."""
    return (HELPERS_TEMPLATE.replace("{series}", _tanh_series()).replace("{ln2}", repr(LN2))
            .replace("{phi_p}", repr(PHI_TAIL_P)).replace("{phi_poly}", _horner(phi_tail(), "t"))
            .replace("{half_log2e}", repr(LOG2E / 2)))


#: The shared helpers' names, read off HELPERS_TEMPLATE (sorted, as the generated imports list them).
HELPER_NAMES = tuple(sorted(re.findall(r"^def (\w+)\(", HELPERS_TEMPLATE, re.M)))

#: The helpers' one home: generated modules import what they use from it (itself generated, from HELPERS_TEMPLATE).
HELPERS_MODULE = Path(__file__).parent / "triton_helpers.py"


def render_helpers() -> str:
    return ("# Generated by approxbp.kernels.codegen (HELPERS_TEMPLATE); DO NOT EDIT: regenerate with "
            "`approxbp export`.\n"
            '"""Float32 primitives and overflow-safe tanh, softplus for the generated Triton modules, which import '
            'what they use."""\n'
            "import os\n\nimport triton\nimport triton.language as tl\n" + helpers_source())


def _import_helpers(*code: str) -> str:
    """The import of the shared helpers that the module's generated code calls (or nothing). Only code is searched,
    never labels or docstrings, which come from users."""
    used = [h for h in HELPER_NAMES if any(f"{h}(" in c for c in code)]
    return f"from approxbp.kernels.triton_helpers import {', '.join(used)}\n" if used else ""

# ---- the PyTorch twins: printed as lambdify prints them, into the generated module -------------------------------
def _lambdified_return(args: list, expr: sp.Expr) -> str:
    """The expression lambdify evaluates for ``expr`` with the torch namespace (the same printed code the
    twins ran when they were lambdified at construction: bit for bit the same operations)."""
    src = inspect.getsource(sp.lambdify(args, expr, modules=[backends.torch_namespace()]))
    lines = src.strip().splitlines()
    if len(lines) != 2 or not lines[1].lstrip().startswith("return "):
        raise AssertionError(f"unexpected lambdify source: {src!r}")
    return lines[1].strip()[len("return "):]


def _twin_def(name: str, args: list, steps: list[tuple[str, sp.Expr]], expr: sp.Expr) -> str:
    """``def name(*args)``: each (local, value) step in order, then the expression (lambdify's printing)."""
    names, lines = list(args), []
    for local, value in steps:
        lines.append(f"    {local} = {_lambdified_return(names, value)}")
        names.append(sp.Symbol(local))
    lines.append(f"    return {_lambdified_return(names, expr)}")
    return f"def {name}({', '.join(map(str, args))}):\n" + "\n".join(lines) + "\n"


def _activation_twin(act, order: int, name: str) -> str:
    """h^(order) as Activation.torch_fn evaluates it (Activation.torch_expr)."""
    return _twin_def(name, [activation_x], [], act.torch_expr(order))


def _form_twin(branch, name: str, variables: tuple[str, ...] = ("y",)) -> str:
    """A stored q form as Form.torch_fn evaluates it: assignments in order, coefficients in place."""
    from approxbp.approximations.invact_forms import Form
    from approxbp.approximations.invact_forms import y as Y

    form = Form.from_table(branch, variables)
    prepare = lambda e: stable_form(form.with_values(e))  # noqa: E731  (as Form.compile prepares each part)
    args = [Y, *(sp.Symbol(v) for v in variables if v != "y")]
    return _twin_def(name, args, [(n, prepare(v)) for n, v in form.assignments], prepare(form.expression))


def _twin_imports(*sources: str) -> str:
    """The torch forms the twins call, bound by name from the function set (never sympy: run time imports this)."""
    namespace = backends.torch_namespace()
    used = sorted({n.id for src in sources for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
                  & set(namespace))
    if not used:
        return ""
    return ("from approxbp.approximations.backends import torch_namespace as _torch_namespace\n\n_TORCH = "
            f"_torch_namespace()\n{', '.join(used)} = {', '.join(f'_TORCH[{n!r}]' for n in used)}\n")


def _twins(*defs: str) -> str:
    """The PyTorch twin section of a generated module (what CPU tensors run, and the tests' oracle)."""
    return (f"\n\n# ---- the PyTorch twin (CPU tensors; the Triton kernels' oracle) {'-' * 50}\n"
            + _twin_imports(*defs) + "\n\n" + "\n\n".join(defs))


#: What every generated module starts with (:func:`_identity` fills it).
HEADER_TEMPLATE = '''\
# Generated by approxbp.kernels.codegen; DO NOT EDIT: regenerate with `approxbp export`.
{docstring}
import triton
import triton.language as tl

TABLE = {table!r}
TABLE_SHA256 = {sha!r}
FORMAT = {format}
FAMILY = {family!r}
NAME = {name!r}
ACTIVATION = {activation!r}
EXPRESSION = {expression!r}
'''

#: The exact activation h, which every module's forward evaluates (after the family's constants).
ACTIVATION_TEMPLATE = '''\
{helpers}

@triton.jit
def activation(x, LOWP: tl.constexpr):
    # LOWP: x holds 16-bit data (its result is rounded to 8 or 11 bits)
    return {source}
'''

RELU_SUM_TEMPLATE = HEADER_TEMPLATE + '''\
BITS = {bits}
STORAGE_BITS = {storage}
KNOTS = {knots!r}
LEVELS = {levels!r}
''' + ACTIVATION_TEMPLATE + '''

@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


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
ROW_TYPES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

#: Up to this k, knots are compile-time comparisons and levels compile-time selects (2^k − 1 of each per
#: element); above it the kernels read them from a small table (a k-step binary search, one gather).
UNROLL_BITS = 4


def _f32(v: float) -> str:
    """A constant as the float32 value the kernels and the twin use (exact in either precision)."""
    return repr(float(np.float32(v)))


def _code_fn(bits: int) -> str:
    """Above UNROLL_BITS: ``code_of``, a k-step binary search over the knots read from a small table (k ≤ UNROLL_BITS
    packs without forming codes, :func:`_codes_for`)."""
    if bits <= UNROLL_BITS:
        return ""
    return "\n".join(["@triton.jit",
                      "def code_of(x, knots_ptr):",
                      "    # code = #{i : c_i < x} (left-continuous; NaN → top code, as torch.bucketize)",
                      "    code = tl.zeros(x.shape, dtype=tl.int32)",
                      f"    for s in tl.static_range({bits}):",
                      f"        probe = code + (1 << ({bits} - 1 - s))",
                      "        code = tl.where(x <= tl.load(knots_ptr + probe - 1), code, probe)",
                      "    return code", "", "", ""])


def _round_down(v: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` ≤ the float32 ``v`` (so x ≤ v ⇔ x ≤ result for every x of that dtype)."""
    t = torch.tensor(v, dtype=torch.float32)
    r = t.to(dtype)
    if r.float() > t:
        r = torch.nextafter(r, torch.tensor(float("-inf"), dtype=dtype))
    return float(r)


def _round_up(v: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` ≥ the float32 ``v`` (so x < v ⇔ x < result for every x of that dtype)."""
    return -_round_down(-v, dtype)


def _by_storage_dtype(dtype_expr: str, lines_for, indent: str) -> list[str]:
    """``if <dtype> == tl.bfloat16: … elif … tl.float16: … else: …`` (a compile-time branch), each body from
    ``lines_for(dtype)`` (None for fp32/fp64): what 16-bit data compares against, rounded to its dtype."""
    out = []
    for head, dtype in ((f"if {dtype_expr} == tl.bfloat16:", torch.bfloat16),
                        (f"elif {dtype_expr} == tl.float16:", torch.float16), ("else:", None)):
        out += [indent + head, *lines_for(dtype)]
    return out


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
    if bits > UNROLL_BITS:
        return f"    return tl.sum(code_of(x, knots_ptr){_wide(storage)} << (lane[None, :] * {storage}), axis=1)"
    as_f32 = [float(np.float32(c)) for c in knots]
    lines = _by_storage_dtype("DT", lambda dt: _codes_for([_round_down(c, dt) for c in as_f32] if dt else as_f32,
                                                          bits, storage, " " * 8, dt), "    ")
    return "\n".join([*lines, "    return tl.sum(word, axis=1)"])


def _level_body(levels: list[float], bits: int) -> str:
    if bits <= UNROLL_BITS:
        lines = [f"    level = tl.full(code.shape, {_f32(levels[0])}, tl.float32)"]
        lines += [f"    level = tl.where(code == {j}, {_f32(v)}, level)" for j, v in enumerate(levels) if j]
        return "\n".join([*lines, "    return level"])
    return "    return tl.load(levels_ptr + code)"


def _identity(table_path: Path, t) -> dict:
    """The constants every generated module starts with: which table (file, definition hash, family, name), in
    which layout (:data:`~.modules.FORMAT`)."""
    return {"table": _relative(table_path), "sha": T.definition_sha256(t), "format": FORMAT, "family": t.family,
            "name": t.name, "activation": t.activation, "expression": t.expression}


REFERENCE_TEMPLATE = '''\
# Generated by approxbp.kernels.codegen (render_reference) for `approxbp cost`; DO NOT EDIT.
"""{docstring}"""
import triton
import triton.language as tl

EXPRESSION = {expression!r}
BLOCK = 4096
''' + ACTIVATION_TEMPLATE + '''

@triton.jit
def activation_grad(x, LOWP: tl.constexpr):
    return {grad_source}


@triton.jit
def forward_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    y = activation(x, x_ptr.dtype.element_ty.primitive_bitwidth <= 16)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def backward_kernel(g_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=offs < n).to(tl.float32)
    d = activation_grad(x, x_ptr.dtype.element_ty.primitive_bitwidth <= 16)
    tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=offs < n)
'''


def render_reference(act) -> str:
    """A plain one-line Triton kernel pair of the exact activation ``act``: y = h(x) saving x, dx = g·h′(x). The
    baseline `approxbp cost` sets beside a new activation's generated kernels (as reference.py is for GELU, SiLU)."""
    source, grad = triton_source(act.expr, lowp=True), triton_source(act.derivative_expr(1), lowp=True)
    doc = f"The exact {act.name}, forward and backward, as one element-wise kernel each (no saving of memory)."
    return REFERENCE_TEMPLATE.format(docstring=doc, expression=act.expression, helpers=_import_helpers(source, grad),
                                     source=source, grad_source=grad)


def render_relu_sum(table_path: Path, t: dict | None = None) -> str:
    t = t or T.load(table_path)
    if t.family != "relu-sum":
        raise ValueError(f"{table_path}: export handles relu-sum tables, got family {t.family!r}")
    act = get_activation(t.expression)
    storage = storage_bits(t.bits)
    doc = (f"{t.activation} with the k={t.bits} ReLU-sum derivative ({t.objective} objective): forward is "
           f"the exact activation plus one packed {storage}-bit code per element; backward is grad × LEVELS[code].\n"
           f"Table: {_relative(table_path)} (definition sha256 {T.definition_sha256(t)}).")
    source = triton_source(act.expr, lowp=True)
    return RELU_SUM_TEMPLATE.format(
        docstring=repr(doc), **_identity(table_path, t),
        bits=t.bits, storage=storage, per_row=8, row_bits=8 * storage, row_type=ROW_TYPES[storage],
        mask=(1 << storage) - 1, knots=tuple(t.knots), levels=tuple(t.levels), helpers=_import_helpers(source),
        source=source, code_fn=_code_fn(t.bits),
        pack_body=_pack_body(t.knots, t.bits, storage), level_body=_level_body(t.levels, t.bits)
    ) + _twins(_activation_twin(act, 0, "activation_twin"))


INVACT_HEAD = HEADER_TEMPLATE + '''\
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
MONOTONE_KERNELS = '''
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
INVACT_KERNELS = '''
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
    t = t or T.load(table_path)
    if t.family != "invact":
        raise ValueError(f"{table_path}: expected an invact table, got family {t.family!r}")
    act = get_activation(t.expression)
    saved = ("nothing but y (increasing: one branch, no bit); backward is grad × q(y)" if t.monotone else
             "one packed branch bit s = [x < T] per element (8 per byte); backward is grad × q_s(y)")
    doc = (f"{t.activation} inverted activation ({t.form} form): forward is the exact activation plus {saved} from "
           f"the saved output y.\nTable: {_relative(table_path)} (definition sha256 {T.definition_sha256(t)}).")
    code = {"source": triton_source(act.expr, lowp=True), "grad_source": triton_source(act.derivative_expr(1)),
            "left": "" if t.monotone else f"\n\n@triton.jit\ndef q_left(y):\n{_jit_body(t.left)}\n",
            "right": _jit_body(t.right),
            "combined": (f"\n\n@triton.jit\ndef q_combined(y, b):\n{_jit_body(t.combined, ('y', 'b'))}\n"
                         if t.combined is not None else ""),
            "rule": TritonPrinter().doprint(backward_rule(t))}
    left_body = "" if t.monotone else "\n".join(_by_storage_dtype("x_ptr.dtype.element_ty", lambda dt: [
        f"        left = x < {(_round_up(t.turning_point, dt) if dt else t.turning_point)!r}"], "    "))
    template = INVACT_HEAD + (MONOTONE_KERNELS if t.monotone else INVACT_KERNELS)
    return template.format(
        docstring=repr(doc), **_identity(table_path, t), monotone="MONOTONE = True\n" if t.monotone else "",
        T=t.turning_point, f_T=t.f_T,
        left_max=None if t.monotone else t.left.domain[1], left_body=left_body, right_max=t.right.domain[1],
        helpers=_import_helpers(*code.values()), **code) + _invact_twins(t, act)


def _invact_twins(t, act) -> str:
    """h, h′, the branch forms and the backward rule (approximations.invact_forms.backward_rule) for torch."""
    defs = [_activation_twin(act, 0, "activation_twin"), _activation_twin(act, 1, "activation_grad_twin"),
            *([] if t.monotone else [_form_twin(t.left, "q_left_twin")]), _form_twin(t.right, "q_right_twin")]
    if t.combined is not None:
        defs.append(_form_twin(t.combined, "q_combined_twin", ("y", "b")))
    rule = backward_rule(t)
    for part in RULE_PARTS:
        rule = rule.replace(sp.Function(part), sp.Function(f"{part}_twin"))
    defs.append(_twin_def("backward_rule_twin", list(sp.symbols("y b")), [], rule))
    return _twins(*defs)


GLU_TEMPLATE = '''\
# Generated by approxbp.kernels.codegen; DO NOT EDIT: regenerate with `approxbp export`.
{docstring}
import triton
import triton.language as tl

FORMAT = {format}
FAMILY = "glu"
NAME = {name!r}
ACTIVATION = {activation!r}
EXPRESSION = {expression!r}
''' + ACTIVATION_TEMPLATE + '''

@triton.jit
def activation_grad(x):
    return {grad_source}


@triton.jit
def forward_kernel(g_ptr, u_ptr, h_ptr, n_elem, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_elem
    g = tl.load(g_ptr + offs, mask=inside, other=0.0)
    u = tl.load(u_ptr + offs, mask=inside, other=0.0)
    if g.dtype != tl.float64:
        g = g.to(tl.float32)
        u = u.to(tl.float32)
    h = activation(g, g_ptr.dtype.element_ty.primitive_bitwidth <= 16) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


@triton.jit
def backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_elem, BLOCK: tl.constexpr):
    # dg = dh·u·act′(g), du = dh·act(g): act(g) recomputed from the saved g
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_elem
    dh = tl.load(dh_ptr + offs, mask=inside, other=0.0)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0)
    u = tl.load(u_ptr + offs, mask=inside, other=0.0)
    if g.dtype != tl.float64:
        dh = dh.to(tl.float32)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
    a = activation(g, g_ptr.dtype.element_ty.primitive_bitwidth <= 16)
    tl.store(dg_ptr + offs, (dh * u * activation_grad(g)).to(dg_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=inside)
    tl.store(du_ptr + offs, (dh * a).to(du_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
'''


def glu_module_path(activation: str, out_dir: Path | None = None) -> Path:
    from .modules import GENERATED

    return (out_dir or GENERATED) / f"{glu_module_name(activation)}.py"


def render_glu(activation: str) -> str:
    """The exact fused GLU of a registry activation: forward h = act(g)·u, backward from the saved g and u
    (act(g) recomputed), with the PyTorch twins of act and act′."""
    act = get_activation(activation)
    doc = (f"Exact gated linear unit with {activation}: h = act(g)·u saves g and u (not act(g)); the backward "
           "recomputes act(g) and act′(g). No approximation: the gradient is the stock one up to rounding.")
    code = {"source": triton_source(act.expr, lowp=True), "grad_source": triton_source(act.derivative_expr(1))}
    return GLU_TEMPLATE.format(docstring=repr(doc), format=FORMAT, name=f"glu-{activation}", activation=activation,
                               expression=str(act.expr), helpers=_import_helpers(*code.values()), **code) + _twins(
        _activation_twin(act, 0, "activation_twin"), _activation_twin(act, 1, "activation_grad_twin"))


def _relative(table_path: Path) -> str:
    """Packaged tables by their path in the repository; a user's table by its absolute path."""
    try:
        return str(Path(table_path).resolve().relative_to(T.data_dir().parent.parent.resolve()))
    except ValueError:
        return str(Path(table_path).resolve())


def render(table_path: Path, t: dict | None = None) -> str:
    """The Triton module of any table (relu-sum or invact)."""
    t = t or T.load(table_path)
    return (render_relu_sum if t.family == "relu-sum" else render_invact)(table_path, t)


def export(tables: list[Path] | None = None, out_dir: Path | None = None) -> list[Path]:
    """(Re)generate a Triton module per table (every packaged table by default) into ``out_dir`` or
    :func:`kernel_dir`; returns the written paths."""
    written = []
    if not tables and out_dir is None:  # the packaged set: the shared helpers and the GLU modules too
        write_atomic(HELPERS_MODULE, render_helpers())
        written.append(HELPERS_MODULE)
        for activation in GLU_ACTIVATIONS:
            write_atomic(glu_module_path(activation), render_glu(activation))
            written.append(glu_module_path(activation))
    for p in tables or T.table_paths("relu-sum") + T.table_paths("invact"):
        t = T.load(p)
        target = module_path(p, t.family, out_dir)
        write_atomic(target, render(Path(p), t))
        written.append(target)
    return written


def export_if_stale(table_path: Path, out_dir: Path | None = None) -> Path | None:
    """Export one table unless its module is already there and current (a note on stderr when it writes);
    returns the written path, or None."""
    from .modules import generated_module

    try:
        generated_module(table_path, T.header(table_path)[0], out_dir)
        return None
    except RuntimeError:
        target = export([Path(table_path)], out_dir)[0]
        print(f"approxbp: generated Triton kernels for {table_path} into {target.parent}", file=sys.stderr)
        return target
