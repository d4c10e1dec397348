"""A restricted parser for expression strings that come from users and from table files.

Expressions are never evaluated: the text is parsed with :mod:`ast` and only this grammar is turned into
sympy objects, node by node::

    expr := number | name | expr (+ - * / ** ^) expr | (+ -) expr | function(expr, …) | ( expr )
          | Piecewise((expr, expr cmp expr), …, (expr, True))     (where the names bind "Piecewise")
          | where(expr cmp expr, expr, expr) | expr if expr cmp expr else expr | select(expr cmp expr, expr, expr)
                                                                   (likewise: numpy's, Python's and ours, as one
                                                                   two-piece Piecewise)

``name`` must be one of the given symbols or constants, ``function`` one of the given functions. No
attributes, subscripts, keywords, lambdas, strings or containers, and comparisons only as a Piecewise condition.
Decimal literals become exact rationals from their written digits (as ``sympify(…, rational=True)`` does), so a
table's constants round-trip.
"""

from __future__ import annotations

import ast
import difflib
from decimal import Decimal, localcontext
from functools import lru_cache

import sympy as sp

__all__ = ["ExpressionError", "parse", "readable"]


#: Longest accepted expression text (the largest committed table expression is far below this).
_MAX_LENGTH = 100_000
#: Largest |exponent| of a number raised to a number (``10**10**10`` would not finish).
_MAX_NUMERIC_EXPONENT = 4096

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: None,  # checked, see _power
    ast.BitXor: None,  # x^2 means x**2, as sympify reads it
}


class ExpressionError(ValueError):
    """An expression string outside the restricted grammar; the message names the text and the problem."""


#: Largest |log2| of a number an expression may contain (float64 reaches 2^1024; beyond, evaluation overflows).
_MAX_NUMBER_BITS = 1100


def _check_number(v: sp.Expr, text: str, what: str) -> sp.Expr:
    """Numbers must stay within float64's range (``1e309`` or a 400-digit integer would overflow every
    evaluator), without building the number first."""
    if v.is_Number and v != 0 and abs(_log2_abs(v)) > _MAX_NUMBER_BITS:
        raise ExpressionError(f"{what} {text[:80]!r}: the number {str(v)[:24]}… is outside float64's range")
    return v


def _log2_abs(v: sp.Number) -> float:
    if v.is_Integer:
        return abs(int(v)).bit_length()
    if v.is_Rational:
        return abs(int(v.p)).bit_length() - abs(int(v.q)).bit_length()
    return float(sp.log(abs(v), 2).evalf(5))


def _power(base: sp.Expr, exponent: sp.Expr, text: str, what: str) -> sp.Expr:
    if base.is_Number and exponent.is_Number:
        if abs(exponent) > _MAX_NUMERIC_EXPONENT:
            raise ExpressionError(f"{what} {text!r}: numeric power with exponent {exponent} is too large")
        if base != 0 and abs(float(exponent) * _log2_abs(base)) > _MAX_NUMBER_BITS:  # before building it
            raise ExpressionError(f"{what} {text[:80]!r}: a numeric power is outside float64's range")
    return base**exponent


def _literal(node: ast.Constant, text: str, what: str, exact: bool) -> sp.Expr:
    v = node.value
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ExpressionError(f"{what} {text!r}: only numbers are allowed as literals, got {v!r}")
    if isinstance(v, int):
        if v.bit_length() > _MAX_NUMBER_BITS:
            raise ExpressionError(f"{what} {text[:80]!r}: the integer {str(v)[:24]}… is outside float64's range")
        return sp.Integer(v)
    if v == float("inf"):
        raise ExpressionError(f"{what} {text[:80]!r}: a literal overflows float64")
    digits = ast.get_source_segment(text, node) or repr(v)
    digits = digits.replace("_", "")
    return _check_number(sp.Rational(digits) if exact else sp.Float(digits, max(15, len(digits))), text, what)


def parse(text: str, names: dict[str, object], what: str = "expression", exact: bool = True) -> sp.Expr:
    """Parse ``text`` into a sympy expression using only ``names`` (symbols, constants and functions).

    Raises :class:`ExpressionError` (a ``ValueError``) with the column of a syntax error or the offending
    construct; nothing in ``text`` is ever executed. ``exact=False`` keeps decimals as sympy Floats."""
    if not isinstance(text, str):
        raise ExpressionError(f"{what} must be a string, got {type(text).__name__}")
    if len(text) > _MAX_LENGTH:
        raise ExpressionError(f"{what} is {len(text)} characters long; at most {_MAX_LENGTH} are accepted")
    return _parse_cached(text.strip(), tuple(sorted(names.items(), key=lambda kv: kv[0])), what, exact)


def _builder(table: dict, text: str, what: str, exact: bool):
    """The node-by-node translation of :func:`parse`'s grammar, over the names in ``table``."""
    def build(node: ast.AST) -> sp.Expr:
        if isinstance(node, ast.Constant):
            return _literal(node, text, what, exact)
        if isinstance(node, ast.Name):
            if not isinstance(table[node.id], sp.Basic):
                raise ExpressionError(f"{what} {text!r}: {node.id!r} is a function; call it, e.g. {node.id}(x)")
            return table[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = build(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = build(node.left), build(node.right)
            fn = _BINARY[type(node.op)]
            return _power(a, b, text, what) if fn is None else fn(a, b)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Piecewise" \
                and callable(table.get("Piecewise")):
            return table["Piecewise"]([piece(a) for a in node.args])
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "where" and _two_pieces(node) is None:
            raise ExpressionError(f"{what} {text!r}: where takes a comparison and two values, where(x > 0, x, 0.1*x)")
        if (two := _two_pieces(node)) is not None and callable(table.get("Piecewise")):
            value, cond, otherwise = two
            return table["Piecewise"]([(build(value), condition(cond)), (build(otherwise), None)])
        if isinstance(node, ast.Call):
            fname = node.func.id if isinstance(node.func, ast.Name) else None
            fn = table.get(fname) if fname else None
            if fn is None or isinstance(fn, sp.Basic) or not callable(fn):
                shown = ast.get_source_segment(text, node.func) or "?"
                allowed = sorted(k for k, v in table.items() if not isinstance(v, sp.Basic))
                raise ExpressionError(f"{what} {text!r}: {shown!r} is not an allowed function; allowed: "
                                      f"{', '.join(allowed)}")
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args) or not node.args:
                raise ExpressionError(f"{what} {text!r}: {fname}(…) takes plain positional arguments")
            return fn(*[build(a) for a in node.args])
        shown = ast.get_source_segment(text, node) or type(node).__name__
        raise ExpressionError(f"{what} {text!r}: {type(node).__name__} ({shown[:40]!r}) is not allowed; "
                              "expressions use numbers, names, + − * / ** and function calls only")

    def piece(node: ast.AST) -> tuple[sp.Expr, sp.Expr | None]:
        """One (value, condition) of a Piecewise: the condition as c of c > 0, None for True."""
        if not (isinstance(node, ast.Tuple) and len(node.elts) == 2):
            raise ExpressionError(f"{what} {text!r}: Piecewise takes (value, condition) pairs")
        value, cond = node.elts
        if isinstance(cond, ast.Constant) and cond.value is True:
            return build(value), None
        return build(value), condition(cond)

    def condition(cond: ast.AST) -> sp.Expr:
        """A comparison as c of c > 0 (x > 3: x − 3; x <= 0: −x)."""
        if not (isinstance(cond, ast.Compare) and len(cond.ops) == 1
                and isinstance(cond.ops[0], ast.Gt | ast.GtE | ast.Lt | ast.LtE)):
            shown = ast.get_source_segment(text, cond) or "?"
            raise ExpressionError(f"{what} {text!r}: a condition is one comparison (x > 3, x <= 0) or, in a "
                                  f"Piecewise, True; not {shown!r}")
        lhs, rhs = build(cond.left), build(cond.comparators[0])
        return lhs - rhs if isinstance(cond.ops[0], ast.Gt | ast.GtE) else rhs - lhs

    return build


def _two_pieces(node: ast.AST) -> tuple[ast.AST, ast.AST, ast.AST] | None:
    """(value, comparison, otherwise) of ``where(c, a, b)``, ``a if c else b`` or ``select(c, a, b)`` with c a
    comparison; None for anything else (``select(c, a, b)`` with c an expression is select itself)."""
    if isinstance(node, ast.IfExp):
        return node.body, node.test, node.orelse
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("where", "select")
            and len(node.args) == 3 and not node.keywords
            and (node.func.id == "where" or isinstance(node.args[0], ast.Compare))):
        cond, value, otherwise = node.args
        return value, cond, otherwise
    return None


@lru_cache(maxsize=4096)
def _parse_cached(text: str, names: tuple, what: str, exact: bool) -> sp.Expr:
    table = dict(names)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        col = max((err.offset or 1) - 1, 0)
        raise ExpressionError(f"cannot parse {what} {text!r}: {err.msg} at column {col + 1}\n"
                              f"    {text}\n    {' ' * col}^") from None
    except (RecursionError, MemoryError, ValueError) as err:
        raise ExpressionError(f"cannot parse {what} {text[:80]!r}…: {type(err).__name__}") from None

    spelled = {"where"} if callable(table.get("Piecewise")) else set()  # where(c, a, b): a two-piece Piecewise
    unknown = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - set(table) - spelled)
    if unknown:
        near = {n: difflib.get_close_matches(n, list(table), n=1) for n in unknown}
        hint = "; ".join(f"did you mean {m[0]!r} for {n!r}?" for n, m in near.items() if m)
        raise ExpressionError(f"{what} {text!r} uses unknown name(s) {unknown}" + (f" ({hint})" if hint else "")
                              + f"; allowed: {', '.join(sorted(table))}")

    build = _builder(table, text, what, exact)

    try:
        expr = build(tree.body)
    except RecursionError:
        raise ExpressionError(f"{what} {text[:80]!r}…: nested too deeply") from None
    except (TypeError, AttributeError) as err:  # e.g. a function given the wrong number of arguments
        raise ExpressionError(f"{what} {text!r}: {err}") from None
    if not isinstance(expr, sp.Expr):
        raise ExpressionError(f"{what} {text!r} is not an arithmetic expression")
    if expr.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
        raise ExpressionError(f"{what} {text!r} is singular (it contains a division by zero or an infinity)")
    if expr.has(sp.I) or any(not a.free_symbols and a.is_real is False for a in sp.preorder_traversal(expr)):
        raise ExpressionError(f"{what} {text!r} is not real (a constant part is complex, e.g. sqrt or a fractional "
                              "power of a negative number)")
    for n in expr.atoms(sp.Number):
        _check_number(n, text, what)
    return expr


def readable(expr: sp.Expr) -> str:
    """``str(expr)`` with each rational whose denominator is a power-of-ten divisor ≥ 10 (a typed decimal) as that
    decimal, exactly (0.05, 1.702, 1.6732632423543772); ½, ¼ and integers stay as they are."""
    decimals = {}
    for r in expr.atoms(sp.Rational):
        q = r.q
        for f in (2, 5):
            while q % f == 0:
                q //= f
        if q == 1 and r.q >= 10:
            with localcontext() as exact:  # the denominator divides a power of ten: a finite decimal
                exact.prec = len(str(r.p)) + len(str(r.q)) + 2
                text = format(Decimal(r.p) / Decimal(r.q), "f")
            decimals[r] = sp.Float(text, len(text.replace("-", "").replace(".", "").lstrip("0")))
    return str(expr.xreplace(decimals))
