"""Coefficient tables (schema ``approxbp.table/1``): the only contract between fitting and kernels.

Readers validate every field and fail with the file name and the field; unknown schema versions are
refused. Writers produce canonical JSON (sorted keys, float64 via ``repr``) so that the same fit
gives the same bytes.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .files import SAFE_NAME, write_atomic
from .relu_sum import MAX_BITS

SCHEMA = "approxbp.table/1"
#: What ``approxbp fit relu-sum --levels free`` writes (FewBit's family): a study result, never a kernel's table.
FREE_LEVELS_SCHEMA = "approxbp.free-levels/1"
FAMILIES = ("relu-sum", "invact")
#: fit: fitted here; paper: a paper's published coefficients; derived: exact, derived from the expression in closed
#: form (``fitting.invact_exact``), with the derivation in ``reference``.
SOURCES = ("fit", "paper", "derived")
OBJECTIVES = ("primitive", "derivative")
#: |Σw − 1| and |Σw·c| allowed in a fitted relu-sum table.
CONSTRAINT_TOL = 1e-12
#: The same for a ``source: paper`` table: the papers print 4–6 significant digits (Approx-BP App. E.2's
#: ReGELU2-d coefficients give 7.9e-4).
PAPER_CONSTRAINT_TOL = 1e-3
#: Fields that describe how and when a table was made, not what it is: left out of :func:`definition_sha256`.
VOLATILE = ("created", "provenance")


class TableError(ValueError):
    """A coefficient table failed validation; the message names the file and the field."""


def data_dir() -> Path:
    """The packaged ``data/coefficients`` folder."""
    return Path(str(resources.files("approxbp.data"))) / "coefficients"


def _fail(where: str, field: str, msg: str):
    raise TableError(f"{where}: field {field!r}: {msg}")


def _need(t: dict, field: str, types, where: str):
    if field not in t:
        _fail(where, field, "missing")
    if not isinstance(t[field], types) or isinstance(t[field], bool):
        _fail(where, field, f"expected {types}, got {type(t[field]).__name__} {t[field]!r:.80}")
    return t[field]


def _floats(t: dict, field: str, where: str, n: int | None = None) -> np.ndarray:
    v = _need(t, field, list, where)
    if not all(isinstance(e, int | float) and not isinstance(e, bool) for e in v):
        _fail(where, field, "expected a list of numbers")
    arr = np.asarray(v, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        _fail(where, field, "contains NaN or ±inf")
    if n is not None and arr.size != n:
        _fail(where, field, f"expected {n} numbers, got {arr.size}")
    return arr


def _held(t: Any) -> Any:
    """The table a fit result holds (``fitting.FitResult``: a dict whose ``table`` is typed), else ``t``."""
    return t["table"] if isinstance(t, dict) and isinstance(t.get("table"), _Table) else t


def _kind(t: dict, where: str) -> str:
    """The schema this approxbp reads and a known family; returns the family."""
    schema = _need(t, "schema", str, where)
    if schema == FREE_LEVELS_SCHEMA:
        _fail(where, "schema", "a free-level (FewBit) fit: approxbp makes no kernels, drop-in or certificate from "
              "one (not implemented); eq. 13's ReLU-sum tables (--levels constrained) and InvAct tables have them")
    if schema != SCHEMA:
        _fail(where, "schema", f"unsupported schema {schema!r}; this approxbp reads {SCHEMA!r}")
    family = _need(t, "family", str, where)
    if family not in FAMILIES:
        _fail(where, "family", f"unknown family {family!r}; known: {FAMILIES}")
    return family


def validate(t: Any, where: str = "<table>") -> dict:
    """Validate a table's JSON object; return it unchanged or raise :class:`TableError`. (A typed table, or a fit
    result holding one, was validated when it was built: its JSON is returned.)"""
    t = _held(t)
    if isinstance(t, _Table):
        return t.to_json()
    if not isinstance(t, dict):
        raise TableError(f"{where}: a table is a JSON object, got {type(t).__name__}")
    family = _kind(t, where)
    for f in ("activation", "expression", "created"):
        _need(t, f, str, where)
    if not t["activation"].isprintable() or not 0 < len(t["activation"]) <= 200:
        _fail(where, "activation", "must be 1–200 printable characters")
    _check_expression(t, where)
    if _need(t, "source", str, where) not in SOURCES:
        _fail(where, "source", f"must be one of {SOURCES}")
    if t["source"] in ("paper", "derived"):
        _need(t, "reference", str, where)
    prov = _need(t, "provenance", dict, where)
    for f in ("method", "command", "package_version"):
        _need(prov, f, str, f"{where} provenance")
    _need(t, "metrics", dict, where)
    if family == "relu-sum":
        _validate_relu_sum(t, where)
    else:
        _validate_invact(t, where)
    if "certified" in t["metrics"]:
        _check_certified(t, where)
    return t


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_certified(t: dict, where: str) -> None:
    """``metrics.certified`` (written by ``approxbp certify``): InvAct branches carry a rigorous bound ≥ the error
    attained and ≥ the sampled L∞; ReLU-sum tables an objective enclosure that holds the recorded loss."""
    c = _need(t["metrics"], "certified", dict, f"{where} metrics")
    if t["family"] == "invact":
        for side in branches_of(t):
            b = _need(c, side, dict, f"{where} metrics.certified")
            for f in ("bound", "attained", "claim", "float32_evaluation"):
                if not (_number(b.get(f)) and b[f] >= 0) and not (f == "float32_evaluation" and b.get(f) is None):
                    _fail(where, f"metrics.certified.{side}.{f}", "must be a finite number ≥ 0"
                          + (" (or null: no finite bound)" if f == "float32_evaluation" else ""))
            sampled = t["metrics"][f"linf_{side}"]
            if b.get("identity", False) is not False:  # proven exact (a derived table): the sample is rounding
                if b["identity"] is not True or b["bound"] != 0 or t["source"] != "derived":
                    _fail(where, f"metrics.certified.{side}.identity", "must be true, with bound 0, on a derived "
                          "table only")
                continue
            if b["bound"] < max(b["attained"], sampled * (1 - 1e-9)):
                _fail(where, f"metrics.certified.{side}.bound", f"{b['bound']!r} is below the error attained "
                      f"({b['attained']!r}) or sampled ({sampled!r}): not a bound")
        return
    lo_hi = c.get("objective")
    if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and all(_number(v) for v in lo_hi)
            and lo_hi[0] <= t["loss"] * (1 + 1e-12) and t["loss"] * (1 - 1e-12) <= lo_hi[1]):
        _fail(where, "metrics.certified.objective", "must be [lower, upper] around the recorded loss")
    if "global_gap" in c and not (_number(c["global_gap"]) and c["global_gap"] >= 0):
        _fail(where, "metrics.certified.global_gap", "must be a finite number ≥ 0")


def _check_expression(t: dict, where: str) -> None:
    """The expression parses (restricted grammar, never evaluated) and is the function the name says."""
    from .activations import get_activation, named_expression

    try:
        expr = get_activation(t["expression"]).expr
    except ValueError as err:
        _fail(where, "expression", str(err))
    name = t["activation"]
    named = named_expression(name)
    if named is None and name != t["expression"]:
        try:
            named = get_activation(name).expression
        except ValueError:
            named = None  # a free-form label such as "my-mish": nothing to compare with
    if named is not None and get_activation(named).expr != expr:
        _fail(where, "expression", f"{t['expression']!r} is not the activation {name!r} ({named})")


def _validate_invact(t: dict, where: str) -> None:
    from .activations import get_activation
    from .invact_forms import Form

    form = _need(t, "form", str, where)
    if not SAFE_NAME.fullmatch(form):
        _fail(where, "form", f"must match {SAFE_NAME.pattern}, got {form!r}")
    monotone = t.get("monotone", False)
    if not isinstance(monotone, bool):
        _fail(where, "monotone", f"must be true or false, got {monotone!r}")
    for f in ("f_T",) if monotone else ("turning_point", "f_T"):
        v = _need(t, f, (int, float), where)
        if not math.isfinite(v):
            _fail(where, f, "must be finite")
    act = get_activation(t["expression"])
    if monotone:
        _check_monotone(t, act, where)
    else:
        T_, f_T = t["turning_point"], t["f_T"]
        slope, value = float(act.df(T_)), float(act.f(T_))
        if abs(slope) > 1e-9:
            _fail(where, "turning_point", f"h′({T_!r}) = {slope:.3g}, not 0: not the minimiser of {t['expression']}")
        if abs(value - f_T) > 1e-12 * max(1.0, abs(f_T)):
            _fail(where, "f_T", f"records {f_T!r} but h(T) = {value!r}")
    f_T = t["f_T"]
    for side in branches_of(t):
        b = _need(t, side, dict, where)
        _need(b, "expression", str, f"{where} {side}")
        coeffs = _need(b, "coefficients", dict, f"{where} {side}")
        if len(coeffs) > MAX_COEFFICIENTS:
            _fail(where, f"{side}.coefficients", f"{len(coeffs)} coefficients; a form has at most {MAX_COEFFICIENTS}")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                   for v in coeffs.values()):
            _fail(where, f"{side}.coefficients", "must map names to finite numbers")
        lo, hi = _floats(b, "domain", f"{where} {side}", 2)
        if not lo < hi:
            _fail(where, f"{side}.domain", f"must be [f(T), end] ascending, got {[lo, hi]}")
        if abs(lo - f_T) > 1e-12 * max(1.0, abs(f_T)):
            _fail(where, f"{side}.domain", f"must start at f(T) = {f_T!r}, got {lo!r}")
        assignments = b.get("assignments", [])
        if not isinstance(assignments, list) or not all(
                isinstance(a, list) and len(a) == 2 and all(isinstance(e, str) for e in a) for a in assignments):
            _fail(where, f"{side}.assignments", "must be a list of [name, expression] pairs")
        try:
            Form.from_table(Branch.from_json(b))
        except ValueError as err:
            _fail(where, f"{side}.expression", str(err))
    if "combined" in t:  # q(y, b), b = 1 on the left branch: one evaluation for both branches (the fast form)
        c = _need(t, "combined", dict, where)
        _need(c, "expression", str, f"{where} combined")
        if len(_need(c, "coefficients", dict, f"{where} combined")) > MAX_COEFFICIENTS:
            _fail(where, "combined.coefficients", f"a form has at most {MAX_COEFFICIENTS} coefficients")
        try:
            Form.from_table(Branch.from_json(c), ("y", "b"))
        except ValueError as err:
            _fail(where, "combined.expression", str(err))
        _check_combined(t, where)
    for m in (f"{k}_{side}" for side in branches_of(t) for k in ("linf", "l2")):
        v = _need(t["metrics"], m, (int, float), f"{where} metrics")
        if not (math.isfinite(v) and v >= 0):
            _fail(where, f"metrics.{m}", f"must be finite and ≥ 0, got {v}")


def branches_of(t) -> tuple[str, ...]:
    """The branches an invact table (JSON or typed) holds: ("right",) for a monotone activation (one branch, no
    bit), else ("left", "right")."""
    return ("right",) if (t.get("monotone", False) if isinstance(t, dict) else t.monotone) else ("left", "right")


#: Where a monotone table's activation is checked: increasing on [−MONOTONE_SPAN, MONOTONE_SPAN], and f_T its
#: infimum (f(−1e8) within 1e-6 of f_T: exponential or algebraic left tails both pass).
MONOTONE_SPAN = 60.0


def not_increasing_at(act) -> float | None:
    """Where h′ is smallest on [−MONOTONE_SPAN, MONOTONE_SPAN] if it is not > 0 there (NaN counts), else None: the
    one test of "increasing" that the tables and the fits share."""
    grid = np.linspace(-MONOTONE_SPAN, MONOTONE_SPAN, 4001)
    with np.errstate(all="ignore"):
        slope = act.df(grid)
    if np.all(slope > 0):
        return None
    return float(grid[np.argmin(np.where(np.isfinite(slope), slope, -np.inf))])


def _check_monotone(t: dict, act, where: str) -> None:
    """A monotone table (one branch, y = f(x) ↦ f′(f⁻¹(y)) with no branch bit): f increases, f_T = inf f, and no
    turning point, left branch or combined form is given."""
    for f in ("turning_point", "left", "combined"):
        if f in t:
            _fail(where, f, "a monotone table has one branch: no turning point, left branch or combined form")
    bad = not_increasing_at(act)
    if bad is not None:
        _fail(where, "monotone", f"h′({bad:.4g}) = {float(act.df(bad)):.3g}: {t['expression']} is not increasing")
    with np.errstate(all="ignore"):
        low = float(act.f(-1e8))
    if not (math.isfinite(low) and abs(low - t["f_T"]) <= 1e-6 * max(1.0, abs(t["f_T"]))):
        _fail(where, "f_T", f"records {t['f_T']!r} but h(−1e8) = {low!r}: f_T must be lim_(x→−∞) h")


def _check_combined(t: dict, where: str) -> None:
    """The combined q(y, b) is what the backward evaluates: on each branch's domain it must be finite and equal the
    branch form (b = 1 left, 0 right) to 1e-9, as every fitted table's does exactly. Checked once per distinct
    (combined, left, right) in a process: a table is loaded at every drop-in's construction."""
    problem = _combined_problem(json.dumps([t["combined"], t["left"], t["right"]], sort_keys=True))
    if problem:
        _fail(where, "combined", problem)


@functools.lru_cache(maxsize=256)
def _combined_problem(forms: str) -> str | None:
    import sympy as sp

    from .activations import numpy_namespace
    from .invact_forms import Form

    combined_json, *branches = json.loads(forms)
    combined = Form.from_table(Branch.from_json(combined_json), ("y", "b"))
    run = combined.compile(numpy_namespace(), [sp.Symbol("b"), *map(sp.Symbol, combined.coefficients)])
    for side, b, branch in zip(("left", "right"), (1.0, 0.0), branches):
        lo, hi = branch["domain"]
        ys = np.linspace(lo, hi, 257)[1:-1]
        with np.errstate(all="ignore"):
            got = np.broadcast_to(np.asarray(run(ys, np.full_like(ys, b), *combined.coefficients.values()),
                                             dtype=np.float64), ys.shape)
        want = Form.from_table(Branch.from_json(branch))(ys)
        err = np.abs(got - want)
        if not np.all(np.isfinite(got)) or not np.all(err <= 1e-9 * (1 + np.abs(want))):
            bad = int(np.argmax(np.where(np.isfinite(got), err, np.inf)))
            return (f"must equal the {side} form on its domain (b = {b:g}); at y = {ys[bad]:.6g} it gives "
                    f"{float(got[bad])!r}, the {side} form {float(want[bad])!r}")
    return None


def _validate_relu_sum(t: dict, where: str) -> None:
    bits = _need(t, "bits", int, where)
    if not 1 <= bits <= MAX_BITS:
        _fail(where, "bits", f"must be in 1..{MAX_BITS}, got {bits}")
    n = 2**bits - 1
    if _need(t, "objective", str, where) not in OBJECTIVES:
        _fail(where, "objective", f"must be one of {OBJECTIVES}")
    a, b = _floats(t, "interval", where, 2)
    if not a < b:
        _fail(where, "interval", f"must be [A, B] with A < B, got {[a, b]}")
    w = _floats(t, "weights", where, n)
    c = _floats(t, "knots", where, n)
    levels = _floats(t, "levels", where, n + 1)
    if np.any(np.diff(c) <= 0):
        _fail(where, "knots", "must be strictly ascending (no repeated knots)")
    if c[0] < a or c[-1] > b:
        _fail(where, "knots", f"must lie inside the interval [{a!r}, {b!r}]")
    if np.max(np.abs(levels - np.concatenate([[0.0], np.cumsum(w)]))) > 1e-14:
        _fail(where, "levels", "do not equal the cumulative sums [0, w1, w1+w2, …] of the weights")
    loss = _need(t, "loss", (int, float), where)
    if not (math.isfinite(loss) and loss >= 0):
        _fail(where, "loss", f"must be finite and ≥ 0, got {loss}")
    res = _need(t, "constraint_residual", (int, float), where)
    actual = max(abs(w.sum() - 1.0), abs(float(np.dot(w, c))))
    if abs(res - actual) > 1e-15 + 1e-9 * actual:
        _fail(where, "constraint_residual", f"records {res!r} but the weights and knots give {actual!r}")
    tol = CONSTRAINT_TOL if t["source"] == "fit" else PAPER_CONSTRAINT_TOL
    if actual > tol:
        _fail(where, "constraint_residual", f"{actual:.3g} > {tol:g}: Σw=1, Σw·c=0 must hold")


def dumps(t: Table | dict) -> str:
    """Canonical JSON text (sorted keys, floats by repr, trailing newline)."""
    t = t._json if isinstance(t, _Table) else t
    return json.dumps(t, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def definition_sha256(t: Table | dict) -> str:
    """sha256 of what a table *is* (coefficients, their definition, metrics), not when or how fast it was made:
    the canonical JSON without :data:`VOLATILE` fields. Generated kernels record this hash."""
    t = t._json if isinstance(t, _Table) else t
    return hashlib.sha256(dumps({k: v for k, v in t.items() if k not in VOLATILE}).encode("utf-8")).hexdigest()


def save(t: Table | dict, path: str | Path, overwrite: bool = True) -> Path:
    """Validate and write atomically. A file that already holds the same definition (it differs at most in
    ``created``/``provenance``) is left untouched, so refitting an unchanged table changes no bytes."""
    path = Path(path)
    t = _held(t)
    t = t.to_json() if isinstance(t, _Table) else validate(t, str(path))
    if path.is_file():
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass --force (overwrite=True) to replace it")
        try:  # kept only if it is a valid table with the same definition
            old = json.loads(path.read_text(encoding="utf-8"))
            if definition_sha256(validate(old, str(path))) == definition_sha256(t):
                return path
        except (ValueError, OSError, RecursionError):
            pass  # unreadable or invalid: replace it
    return write_atomic(path, dumps(t), overwrite=overwrite)


def resolve(path: str | Path, family: str | None = None) -> Path:
    """The file of a table: ``family/name`` (or just ``name`` when ``family`` is given) of a packaged table, or a
    path; ``.json`` may be left out. A packaged name always means the packaged table, even where the working
    directory holds a file of that relative path (a crafted folder must not stand in for it): to use such a file,
    write the path as ``./relu_sum/…`` or absolute."""
    p = Path(path)
    explicit = p.is_absolute() or str(path).startswith(("./", "../", ".\\", "..\\"))
    if not explicit:
        name = str(path) if str(path).endswith(".json") else f"{path}.json"
        if family is not None and "/" not in name:
            name = f"{family.replace('-', '_')}/{name}"
        if (data_dir() / name).is_file():
            return data_dir() / name
    if not p.exists():
        raise FileNotFoundError(f"no coefficient table at {path!s} (packaged tables live in {data_dir()})")
    return p


#: The largest table file read (the packaged ones are under 20 KiB): a hostile file cannot make reading it slow.
MAX_TABLE_BYTES = 1 << 20
#: The most coefficients one InvAct form may name (the packaged forms have under 40).
MAX_COEFFICIENTS = 256


def read_json(path: str | Path) -> dict:
    """A table file's JSON object, unvalidated (:func:`load` validates; :func:`header` checks what run time needs).
    Files over :data:`MAX_TABLE_BYTES` are refused unread."""
    p = resolve(path)
    size = p.stat().st_size
    if size > MAX_TABLE_BYTES:
        raise TableError(f"{p}: {size} bytes; a coefficient table is at most {MAX_TABLE_BYTES} bytes")
    try:
        t = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TableError(f"{p}: not valid JSON: {err}") from None
    except RecursionError:
        raise TableError(f"{p}: JSON nested too deeply to be a table") from None
    except UnicodeDecodeError as err:
        raise TableError(f"{p}: not UTF-8 text: {err.reason}") from None
    if not isinstance(t, dict):
        raise TableError(f"{p}: a table is a JSON object, got {type(t).__name__}")
    return t


def header(path: str | Path, family: str | None = None) -> tuple[str, str]:
    """(family, definition sha256) of a table file, checking its schema and (given) family, without parsing its
    expressions: what the kernels' run time reads. Its numbers come from the generated module made from the
    validated table with this definition hash."""
    t, where = read_json(path), str(path)
    found = _kind(t, where)
    if family is not None and found != family:
        raise TableError(f"{where}: expected a {family} table, got {found!r}")
    return found, definition_sha256(t)


def stored_metrics(path: str | Path) -> dict:
    """A table file's metrics, its schema checked, without parsing its expressions (what the run time reports)."""
    t = read_json(path)
    _kind(t, str(path))
    return dict(t.get("metrics") or {})


def load(path: str | Path) -> Table:
    """Read, validate and type one table (a path, or ``family/name`` inside the packaged data)."""
    p = resolve(path)
    return from_json(read_json(p), str(p))


def packaged_name(path: str | Path) -> str | None:
    """``family_dir/name`` of a packaged table file (what :func:`resolve` and :func:`load` accept), else None."""
    p, data = Path(path).resolve(), data_dir().resolve()
    return p.relative_to(data).with_suffix("").as_posix() if p.is_relative_to(data) else None


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (not :func:`definition_sha256`, what ``Table.sha256`` is)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def table_paths(family: str | None = None) -> list[Path]:
    """All packaged tables (of one family), sorted."""
    root = data_dir()
    pattern = f"{family.replace('-', '_')}/*.json" if family else "*/*.json"
    return sorted(root.glob(pattern))


def relu_sum_name(activation: str, bits: int, objective: str, source: str = "fit") -> str:
    """Canonical file stem, e.g. ``gelu-k2-primitive`` or ``gelu-k2-primitive-paper``."""
    stem = f"{activation}-k{bits}-{objective}"
    return stem if source == "fit" else f"{stem}-paper"


# ---- typed tables: the one place a table's fields are read by key ---------------------------------------------
@dataclass(frozen=True)
class Branch:
    """One InvAct q form: an expression in y (and b, for the combined form), its coefficients, the named
    intermediates assigned before it, the y-domain it was fitted on (None for the combined form) and its
    operation count."""

    expression: str
    coefficients: dict
    assignments: tuple = ()
    domain: tuple | None = None
    operations: int | None = None

    @classmethod
    def from_json(cls, d: dict) -> Branch:
        return cls(d["expression"], dict(d["coefficients"]), tuple(tuple(a) for a in d.get("assignments", ())),
                   tuple(d["domain"]) if "domain" in d else None, d.get("operations"))


@dataclass(frozen=True, eq=False)
class _Table(Mapping):
    """What both table types share. A table is built from its JSON by :func:`from_json` (validated there, and
    nowhere else) and keeps that JSON for :meth:`to_json`, so files round-trip byte for byte. It is also a
    read-only mapping of its JSON fields (``t["knots"]``, ``{**t}``) for notebooks and tests; library code reads
    attributes."""

    family: ClassVar[str]
    folder: ClassVar[str]
    activation: str
    expression: str
    source: str
    metrics: dict
    provenance: dict
    created: str
    reference: str | None
    _json: dict = field(repr=False)

    def to_json(self) -> dict:
        return copy.deepcopy(self._json)

    def __getitem__(self, key: str):
        """A read-only view of the JSON fields (notebooks, tests); library code uses the attributes."""
        return self._json[key]

    def __iter__(self):
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)

    def __or__(self, other: dict) -> dict:
        """``t | {"bits": 3}``: the JSON object with fields replaced (a dict, to validate or build again)."""
        return {**self.to_json(), **other}

    def __eq__(self, other) -> bool:
        return isinstance(other, _Table) and self._json == other._json

    __hash__ = None

    @cached_property
    def sha256(self) -> str:
        """:func:`definition_sha256` of this table (computed once)."""
        return definition_sha256(self._json)

    @property
    def file_name(self) -> str:
        """The canonical packaged path, ``<folder>/<name>.json``."""
        return f"{self.folder}/{self.name}.json"

    def with_metrics(self, **changes):
        """The same table with metrics added or replaced (e.g. ``certified``), validated again."""
        d = self.to_json()
        d["metrics"].update(changes)
        return from_json(d)

    def with_provenance(self, **changes):
        """The same table with provenance fields changed (e.g. the command that regenerates it)."""
        d = self.to_json()
        d["provenance"].update(changes)
        return from_json(d)


@dataclass(frozen=True, eq=False)
class ReluSumTable(_Table):
    """A ReLU-sum table (Approx-BP eq. 13): h̃(x) = Σ w_i·ReLU(x − c_i), levels = [0, w₁, w₁+w₂, …]."""

    family: ClassVar[str] = "relu-sum"
    folder: ClassVar[str] = "relu_sum"
    bits: int
    objective: str
    interval: tuple
    knots: tuple
    weights: tuple
    levels: tuple
    loss: float
    constraint_residual: float
    @property
    def name(self) -> str:
        return relu_sum_name(self.activation, self.bits, self.objective, self.source)


@dataclass(frozen=True, eq=False)
class InvActTable(_Table):
    """An inverted-activation table: T, f(T), the two branch forms q_left/q_right and, optionally, the combined
    form q(y, b) (Inverted Activations §2). A ``monotone`` table (softplus, squareplus) has one branch, q_right on
    the whole range [f_T = inf f, …), no turning point and no branch bit."""

    family: ClassVar[str] = "invact"
    folder: ClassVar[str] = "invact"
    form: str
    turning_point: float | None
    f_T: float
    left: Branch | None
    right: Branch
    combined: Branch | None
    monotone: bool
    @property
    def name(self) -> str:
        return f"{self.activation}-{self.form}"

    @property
    def branches(self) -> tuple[str, ...]:
        """:func:`branches_of` this table."""
        return branches_of(self)


Table = ReluSumTable | InvActTable


def from_json(d: dict, where: str = "<table>") -> Table:
    """Validate a table's JSON object and build its typed table: the one place tables are built."""
    d = validate(copy.deepcopy(d), where)
    cls = ReluSumTable if d["family"] == "relu-sum" else InvActTable
    values = {}
    for f in fields(cls):
        if f.name == "_json":
            continue
        v = d.get(f.name)
        if f.name in ("left", "right", "combined"):
            v = None if v is None else Branch.from_json(v)
        elif f.name == "monotone":
            v = bool(v)
        elif isinstance(v, list):
            v = tuple(v)
        values[f.name] = v
    return cls(**values, _json=d)


def as_table(t: Table | dict) -> Table:
    """A typed table from a table, its JSON object (validated) or a fit result holding one."""
    t = _held(t)
    return t if isinstance(t, _Table) else from_json(t)

