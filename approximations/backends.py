"""The function set: one table saying how each function an expression may call is written in every backend.

Each :class:`Fn` gives a function's sympy form (what the grammars bind its name to), its numpy, mpmath and torch
evaluators, its Arb ball forms (value and derivative, for ``approxbp certify``), its Triton form (what ``approxbp
export`` prints) and the float32 error of that Triton form. Everything else derives from :data:`FUNCTIONS`: the
activation and form grammars (:func:`grammar`), the lambdify namespaces (:func:`numpy_namespace`,
:func:`mpmath_namespace`, :func:`torch_namespace`), the ball evaluator (``fitting.intervals``) and the Triton printer
(``kernels.codegen``). Adding a function is adding one entry here; a function without a Triton form parses and
evaluates everywhere, and export refuses it with its name.

Importing this module imports neither sympy nor torch nor flint: the kernels' runtime reads :func:`torch_namespace`
(the generated modules' PyTorch twins call it), and each backend is imported when its forms are first used.

:data:`_SAME` means "the backend's own function of that name" (numpy/scipy, mpmath, torch with ``math`` for Python
numbers); None means the backend has no form (the certifier, or export, refuses the function by name).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .balls import arb_type, monotone, square

__all__ = ["arb_forms", "branch_cuts", "Fn", "fp32_ulps", "FUNCTIONS", "functions", "grammar", "Lazy",
           "mpmath_namespace", "numpy_namespace", "rough_functions", "torch_namespace"]


_SAME = "same"


@dataclass(frozen=True)
class Lazy:
    """A backend form made on first use, so that its library is imported then: ``make()`` returns the callable."""

    make: Callable[[], Callable]


@dataclass(frozen=True)
class Fn:
    """One function of the set. ``sympy``: a zero-argument callable giving the sympy function (called when a
    grammar is built); ``numpy``, ``mpmath``, ``torch``: the evaluator (:data:`_SAME`: the library's own function of
    that name; None: none; :class:`Lazy`: made on first use); ``expand``: how the *activation* grammar writes the
    name instead (an elementary expression that ``stable_form`` turns back, e.g. softplus = log(1 + e^u)),
    ``alias_only``: the name is only such an expansion (log1p: no function of its own); ``triton``: a format
    string over the printed arguments (``"tl.exp({0})"``) or a callable (printer, expr) → str for forms that look at
    the arguments; ``smooth``: False for functions the ReLU-sum fits refuse (they need h′ and h″ everywhere);
    ``branch_cut``: Arb's integration must check analyticity; ``in_activations``: the activation grammar accepts the
    name."""

    name: str
    sympy: Callable[[], Any] | None
    numpy: Any = _SAME
    mpmath: Any = _SAME
    torch: Any = _SAME
    arb: tuple[Callable, Callable] | None = None
    triton: str | Callable | None = None
    fp32_ulps: float | None = None
    expand: Callable | None = None
    aliases: tuple[str, ...] = ()
    smooth: bool = True
    branch_cut: bool = False
    in_activations: bool = True
    alias_only: bool = False


# ---- sympy forms (lazy: sympy is a build-time import) ------------------------------------------------------------
def _sp(name: str) -> Callable[[], Any]:
    def resolve():
        import sympy

        return getattr(sympy, name)
    return resolve


def _ours(name: str) -> Callable[[], Any]:
    """One of the sympy function classes defined in :mod:`.functions` (Phi, sigmoid, softplus, select)."""
    def resolve():
        from . import functions

        return getattr(functions, name)
    return resolve


def _log1p_exp(u):
    import sympy

    return sympy.log(1 + sympy.exp(u))


# ---- torch forms: tensors go to torch, Python numbers (constants) to math ----------------------------------------
def _either(name: str) -> Callable:
    import torch

    tfn, mfn = getattr(torch, name), getattr(math, name)
    return lambda *a: tfn(*a) if any(isinstance(v, torch.Tensor) for v in a) else mfn(*a)


def _extremum(both, clamp, scalar):
    """max/min of two arguments, NaN-propagating; a Python number stays a scalar (torch.as_tensor would round it to
    float32 and change float64 results)."""
    import torch

    def pair(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return both(a, b)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            t, v = (a, b) if isinstance(a, torch.Tensor) else (b, a)
            return clamp(t, v)
        return scalar(a, b)

    return pair


def _torch_max():
    import torch

    return lambda *a: functools.reduce(_extremum(torch.maximum, torch.clamp_min, max), a)


def _torch_min():
    import torch

    return lambda *a: functools.reduce(_extremum(torch.minimum, torch.clamp_max, min), a)


def _torch_phi():
    # Φ(u) = erfc(−u/√2)/2: torch.special.ndtr loses the left tail (fp32: 114 % relative error at u = −5.55; fp64: 0
    # at u = −12), this form keeps ≤ 1.1e-5 relative error in fp32 down to u = −12 (against scipy)
    import torch

    return lambda u: 0.5 * torch.erfc(u * -math.sqrt(0.5))


def _torch(attr: str) -> Lazy:
    def resolve():
        import torch

        return getattr(torch, attr)
    return Lazy(resolve)


def _torch_softplus():
    import torch

    return lambda u: torch.logaddexp(torch.zeros_like(u), u)


def _torch_select():
    import torch

    def select(c, a, b):
        """a where c > 0, else b; two numbers take c's floating dtype (torch.where would give float32 values:
        q = select(y, 1, 1/10) on float64 y returned 0.10000000149)."""
        c = torch.as_tensor(c)
        if c.is_floating_point() and not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a, b = torch.as_tensor(a, dtype=c.dtype), torch.as_tensor(b, dtype=c.dtype)
        return torch.where(c > 0, a, b)

    return select


# ---- numpy and mpmath forms that differ from the library's own function of the same name ------------------------
def _scipy(attr: str) -> Lazy:
    def resolve():
        import scipy.special

        return getattr(scipy.special, attr)
    return Lazy(resolve)


def _np_softplus():
    import numpy as np

    return lambda u: np.logaddexp(0.0, u)


def _np_heaviside():
    import numpy as np

    return lambda u, *half: np.heaviside(u, 0.5)


def _torch_heaviside():
    import torch

    def step(u, *half):  # H(0) = ½, sympy's convention; a Python number stays a number
        if not isinstance(u, torch.Tensor):
            return 1.0 if u > 0 else 0.5 if u == 0 else 0.0
        return torch.where(u > 0, 1.0, torch.where(u == 0, 0.5, 0.0)).to(u.dtype)
    return step


def _mp_heaviside():
    import mpmath

    return lambda u, *half: mpmath.mpf(u > 0) + mpmath.mpf(u == 0) / 2  # H(0) = ½, as sympy's


def _np_zero():
    import numpy as np

    return lambda u, *order: np.zeros_like(np.asarray(u, dtype=np.float64))


def _mp_zero():
    import mpmath

    return lambda u, *order: mpmath.mpf(0)


def _torch_zero():
    import torch

    return lambda u, *order: torch.zeros_like(u) if isinstance(u, torch.Tensor) else 0.0


def _mp_select():
    return lambda c, a, b: a if c > 0 else b


def _np_select():
    import numpy as np

    return lambda c, a, b: np.where(np.asarray(c) > 0, a, b)


def _mp(fn: Callable[[Any], Any]) -> Lazy:
    def resolve():
        import mpmath

        return lambda u: fn(mpmath, u)
    return Lazy(resolve)


# ---- Arb ball forms (f, f′): methods, so that arb and acb (Arb's complex integration) both evaluate them ----------
def _pi():
    return arb_type().pi()


def _exp(z):
    return monotone(lambda u: u.exp(), z)


def _normal_pdf(z):
    return _exp(-square(z) / 2) / (2 * _pi()).sqrt()


def _sigmoid(z):
    return monotone(lambda u: 1 / (1 + (-u).exp()), z)


def _softplus(z):
    if isinstance(z, arb_type()):
        return monotone(lambda u: u.exp().log1p() if u < 0 else u + (-u).exp().log1p(), z)
    return (1 + z.exp()).log()


def _tanh(z):
    if not hasattr(z, "tanh"):  # a power series (arb_series has no tanh): 1 − 2/(e^{2z} + 1)
        return 1 - 2 / ((2 * z).exp() + 1)
    return monotone(lambda u: u.tanh(), z)


def _sqrt(z):
    return monotone(lambda u: u.sqrt(), z)


def _erf_slope(z):
    return 2 * _exp(-square(z)) / _pi().sqrt()


def _Phi(z):  # noqa: N802
    return monotone(lambda u: (-u / arb_type()(2).sqrt()).erfc() / 2, z)


# ---- Triton forms that look at their arguments (build time: they receive sympy nodes) -----------------------------
def _triton_phi(p, e):
    """Φ(z) = (1 + erf(z/√2))/2 (tl has no erfc; its left tail cancels, as F.gelu's does); for 16-bit data the
    helper ``_phi(u, LOWP)`` (approximations.elementary.phi_tail)."""
    if p.lowp:
        return f"_phi({p._print(e.args[0])}, LOWP)"
    return f"(0.5 * (1.0 + tl.math.erf(0.7071067811865476 * ({p._print(e.args[0])}))))"


def _triton_select(p, e):
    """tl.where; u + c > 0 is printed as u > −c (one add fewer): the same test in floating point, since a sum of two
    floats rounds to zero only when it is exactly zero."""
    cond, a, b = e.args
    c = next((t for t in cond.args if t.is_Number), None) if cond.is_Add else None
    test = f"({p._print(cond - c)}) > {-float(c)!r}" if c is not None else f"({p._print(cond)}) > 0.0"
    return f"tl.where({test}, {p._print(a)}, {p._print(b)})"


def _nest(p, name, args):
    # NaN propagates, as torch.maximum/minimum do in the twin (tl's default would drop it)
    out = p._print(args[0])
    for a in args[1:]:
        out = f"{name}({out}, {p._print(a)}, propagate_nan=tl.PropagateNan.ALL)"
    return out


def _triton_max(p, e):
    """max(w₀, log(max(c, u))) = log(max(u, e^w₀)) when e^w₀ ≥ c: a clamped log (the fast InvAct tail) runs on the
    cheap ``_log`` (MUFU.LG2, which flushes subnormals: the clamp keeps its argument a normal number)."""
    if len(e.args) == 2:
        w0 = next((a for a in e.args if a.is_Number), None)
        lg = next((a for a in e.args if type(a).__name__ == "log"), None)
        inner = lg.args[0] if lg is not None else None
        if w0 is not None and type(inner).__name__ == "Max" and len(inner.args) == 2:
            c = next((a for a in inner.args if a.is_Number), None)
            u = next((a for a in inner.args if not a.is_Number), None)
            floor = math.exp(float(w0))
            if c is not None and u is not None and floor >= max(float(c), 2.0**-125):
                return f"_log(tl.maximum({p._print(u)}, {floor!r}, propagate_nan=tl.PropagateNan.ALL))"
    return _nest(p, "tl.maximum", e.args)


def _triton_sinh(p, e):
    """(e^u − e^−u)/2 cancels near 0: for |u| < 0.5 the odd series to u¹³ (error < 1e-15)."""
    u = p._print(e.args[0])
    z2 = f"({u}) * ({u})"
    series = repr(1 / math.factorial(13))
    for j in range(5, -1, -1):
        series = f"{1 / math.factorial(2 * j + 1)!r} + {z2} * ({series})"
    return f"tl.where(tl.abs({u}) < 0.5, ({u}) * ({series}), 0.5 * (tl.exp({u}) - tl.exp(-({u}))))"


#: The function set. CUDA's float32 errors (ulps) are from the CUDA C++ Programming Guide, "Mathematical Functions";
#: Φ, σ and softplus are the composites the Triton forms compute; log is the kernels' ``_log`` (MUFU.LG2), bounded
#: by ``certify.log_error`` instead.
FUNCTIONS: dict[str, Fn] = {f.name: f for f in (
    Fn("exp", _sp("exp"), arb=(_exp, _exp), triton="tl.exp({0})", fp32_ulps=2.0),
    Fn("log", _sp("log"), arb=(lambda z: monotone(lambda u: u.log(), z), lambda z: 1 / z), triton="tl.log({0})",
       branch_cut=True),
    Fn("sqrt", _sp("sqrt"), arb=(_sqrt, lambda z: 1 / (2 * _sqrt(z))), triton="tl.sqrt({0})", fp32_ulps=1.0,
       branch_cut=True),
    Fn("erf", _sp("erf"), arb=(lambda z: monotone(lambda u: u.erf(), z), _erf_slope), triton="tl.math.erf({0})",
       fp32_ulps=2.0),
    Fn("erfc", _sp("erfc"), arb=(lambda z: monotone(lambda u: u.erfc(), z, False), lambda z: -_erf_slope(z)),
       triton="(1.0 - tl.math.erf({0}))", fp32_ulps=4.0),  # 1 − erf: cancels for large arguments (tl has no erfc)
    Fn("tanh", _sp("tanh"), arb=(_tanh, lambda z: 1 - square(_tanh(z))), triton="_tanh({0})", fp32_ulps=2.0),
    Fn("sinh", _sp("sinh"), arb=(lambda z: monotone(lambda u: u.sinh(), z), lambda z: z.cosh()), triton=_triton_sinh,
       fp32_ulps=3.0),
    Fn("cosh", _sp("cosh"), arb=(lambda z: z.cosh(), lambda z: monotone(lambda u: u.sinh(), z)),
       triton="(0.5 * (tl.exp({0}) + tl.exp(-({0}))))", fp32_ulps=3.0),
    Fn("sin", _sp("sin"), arb=(lambda z: z.sin(), lambda z: z.cos()), triton="tl.sin({0})", fp32_ulps=2.0),
    Fn("cos", _sp("cos"), arb=(lambda z: z.cos(), lambda z: -z.sin()), triton="tl.cos({0})", fp32_ulps=2.0),
    Fn("atan", _sp("atan"), arb=(lambda z: monotone(lambda u: u.atan(), z), lambda z: 1 / (1 + square(z))),
       fp32_ulps=2.0),  # no Triton form: export refuses it
    Fn("Abs", _sp("Abs"), torch=abs, triton="tl.abs({0})", aliases=("abs",), smooth=False),
    Fn("Max", _sp("Max"), torch=Lazy(_torch_max), triton=_triton_max, smooth=False),
    Fn("Min", _sp("Min"), torch=Lazy(_torch_min), triton=lambda p, e: _nest(p, "tl.minimum", e.args), smooth=False),
    Fn("Phi", _ours("Phi"), numpy=_scipy("ndtr"), mpmath=_mp(lambda mp, u: mp.ncdf(u)), torch=Lazy(_torch_phi),
       arb=(_Phi, _normal_pdf), triton=_triton_phi, fp32_ulps=6.0),
    Fn("sigmoid", _ours("sigmoid"), numpy=_scipy("expit"), mpmath=_mp(lambda mp, u: 1 / (1 + mp.exp(-u))),
       torch=_torch("sigmoid"), arb=(_sigmoid, lambda z: _sigmoid(z) * _sigmoid(-z)),
       triton="_rcp(1.0 + tl.exp(-({0})))", fp32_ulps=5.0),  # 1/(1 + e^{−u}): e^{−u} = inf gives 0
    Fn("softplus", _ours("softplus"), numpy=Lazy(_np_softplus), mpmath=_mp(lambda mp, u: mp.log1p(mp.exp(u))),
       torch=Lazy(_torch_softplus), arb=(_softplus, _sigmoid), triton="_softplus({0})", fp32_ulps=8.0,
       expand=_log1p_exp, branch_cut=True),
    # The unit step H (H(0) = ½): the derivative of a piecewise activation (Max(0, x)**2: 2·H(x)·Max(0, x))
    Fn("Heaviside", _sp("Heaviside"), numpy=Lazy(_np_heaviside), mpmath=Lazy(_mp_heaviside),
       torch=Lazy(_torch_heaviside), triton="tl.where(({0}) > 0.0, 1.0, tl.where(({0}) == 0.0, 0.5, 0.0))",
       smooth=False, in_activations=False),
    # Its derivative, a point mass at a kink: 0 wherever a function is evaluated (only h″'s knot densities and
    # the ReLU-sum fits' grids read it, away from the kinks' single points)
    Fn("DiracDelta", _sp("DiracDelta"), numpy=Lazy(_np_zero), mpmath=Lazy(_mp_zero), torch=Lazy(_torch_zero),
       triton="0.0 * ({0})", smooth=False, in_activations=False),
    # select(c, a, b) = a where c > 0, else b: also what Piecewise(…) becomes, so a table of it reads back
    Fn("select", _ours("select"), numpy=Lazy(_np_select), mpmath=Lazy(_mp_select), torch=Lazy(_torch_select),
       triton=_triton_select, smooth=False),
    # Written as its elementary form: log1p is exact as log(1 + u); the float64 evaluators then lose relative (not
    # absolute) accuracy for |u| < 1e-8. expm1 (above) is written e^u − 1 too, and stable_form turns c·e^u − c back
    Fn("log1p", None, expand=lambda u: _sp("log")()(1 + u), alias_only=True),
    Fn("expm1", _ours("expm1"), mpmath=_mp(lambda mp, u: mp.expm1(u)),
       arb=(lambda z: monotone(lambda u: u.expm1(), z), _exp), triton="_expm1({0})",
       fp32_ulps=3.0, expand=lambda u: _sp("exp")()(u) - 1),
)}

#: Named constants the grammars accept: name → (sympy name, float value).
_CONSTANTS = {"pi": ("pi", math.pi), "E": ("E", math.e)}


def _resolve(form):
    """A backend form: a :class:`Lazy` one is made now; one given directly (e.g. ``torch.asinh``) is itself."""
    return form.make() if isinstance(form, Lazy) else form


def functions(*, triton: bool | None = None) -> list[Fn]:
    """The functions that are more than an alias (``triton``: only those with / without a Triton form)."""
    return [f for f in FUNCTIONS.values() if not f.alias_only and (triton is None or (f.triton is not None) == triton)]


def grammar(kind: str) -> dict[str, Any]:
    """What a parser binds names to: ``"activation"`` (expansions such as softplus = log(1 + e^u) and the
    aliases, no select) or ``"form"`` (every function as itself, for stored InvAct forms and SR output)."""
    import sympy

    out: dict[str, Any] = {name: getattr(sympy, sym) for name, (sym, _) in _CONSTANTS.items()}
    for f in FUNCTIONS.values():
        if kind == "activation" and not f.in_activations:
            continue
        if kind == "form" and f.alias_only:
            continue
        bound = f.expand if (kind == "activation" and f.expand is not None) else f.sympy()
        for name in (f.name, *f.aliases):
            out[name] = bound
    return out


def rough_functions() -> tuple[str, ...]:
    """Names of the functions the fits refuse in an activation (not smooth)."""
    return tuple(f.name for f in FUNCTIONS.values() if not f.smooth)


def numpy_namespace() -> list:
    """lambdify modules for float64 numpy: our own forms (tail-accurate Φ, σ, softplus), then scipy and numpy."""
    return [{f.name: _resolve(f.numpy) for f in functions() if f.numpy not in (_SAME, None)}, "scipy", "numpy"]


def mpmath_namespace() -> list:
    """lambdify modules for mpmath: our own forms, then mpmath's."""
    return [{f.name: _resolve(f.mpmath) for f in functions() if f.mpmath not in (_SAME, None)}, "mpmath"]


def torch_namespace() -> dict:
    """Names for lambdifying into torch (and what the generated PyTorch twins import): tensors go to torch, Python
    numbers (constants) to math."""
    names = {f.name: _either(f.name) if f.torch == _SAME else _resolve(f.torch)
             for f in functions() if f.torch is not None}
    names.update({name: value for name, (_, value) in _CONSTANTS.items()})
    return names


def arb_forms() -> dict[str, tuple[Callable, Callable]]:
    """name → (f, f′) on Arb balls, for the functions the certifier evaluates directly (Abs, Max, Min and select
    are decided structurally there)."""
    return {f.name: f.arb for f in functions() if f.arb is not None}


def fp32_ulps() -> dict[str, float]:
    return {f.name: f.fp32_ulps for f in functions() if f.fp32_ulps is not None}


def branch_cuts() -> tuple[str, ...]:
    return tuple(f.name for f in functions() if f.branch_cut)
