"""Coefficient tables (schema ``approxbp.table/1``): the only contract between fitting and kernels.

Readers validate every field (:mod:`.table_checks`) and fail with the file name and the field; unknown schema
versions are refused. Writers produce canonical JSON (sorted keys, float64 via ``repr``) so that the same fit
gives the same bytes. Tables are built by :func:`from_json` (a file's object) or by :meth:`ReluSumTable.new` and
:meth:`InvActTable.new` (a fit's numbers); this module reads and writes them and imports no sympy.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from .families import TABLE_FAMILIES, TableFamily, lazy, member, register
from .files import write_atomic
from .table_schema import (
    MAX_TABLE_BYTES,
    SCHEMA,
    VOLATILE,
    Branch,
    TableError,
    branches_of,
    kind,
)

__all__ = ["as_table", "data_dir", "definition_sha256", "dumps", "from_json", "header", "InvActTable", "is_table",
           "load", "new_fields", "packaged_name", "read_json", "relu_sum_name", "ReluSumTable", "resolve", "save",
           "stored_metrics", "Table", "table_paths", "validate"]


def validate(t: Any, where: str = "<table>") -> dict:
    """Validate a table's JSON object (:func:`.table_checks.check`); return it unchanged or raise
    :class:`TableError`. (A typed table, or a fit result holding one, was validated when it was built: its JSON is
    returned.)"""
    t = _held(t)
    if isinstance(t, Table):
        return t.to_json()
    from .table_checks import check

    return check(t, where)


def data_dir() -> Path:
    """The packaged ``data/coefficients`` folder."""
    return Path(str(resources.files("approxbp.data"))) / "coefficients"


def _held(t: Any) -> Any:
    """The table a fit result holds (``fitting.FitResult``: a dict whose ``table`` is typed), else ``t``."""
    return t["table"] if isinstance(t, dict) and isinstance(t.get("table"), Table) else t


def dumps(t: Table | dict) -> str:
    """Canonical JSON text (sorted keys, floats by repr, trailing newline)."""
    t = t._json if isinstance(t, Table) else t
    return json.dumps(t, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def definition_sha256(t: Table | dict) -> str:
    """sha256 of what a table *is* (coefficients, their definition, metrics), not when or how fast it was made:
    the canonical JSON without :data:`VOLATILE` fields. Generated kernels record this hash."""
    t = t._json if isinstance(t, Table) else t
    return hashlib.sha256(dumps({k: v for k, v in t.items() if k not in VOLATILE}).encode("utf-8")).hexdigest()


def save(t: Table | dict, path: str | Path, overwrite: bool = True) -> Path:
    """Validate and write atomically. A file that already holds the same definition (it differs at most in
    ``created``/``provenance``) is left untouched, so refitting an unchanged table changes no bytes."""
    path = Path(path)
    t = _held(t)
    t = t.to_json() if isinstance(t, Table) else validate(t, str(path))
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
    found = kind(t, where)
    if family is not None and found != family:
        raise TableError(f"{where}: expected a {family} table, got {found!r}")
    return found, definition_sha256(t)


def stored_metrics(path: str | Path) -> dict:
    """A table file's metrics, its schema checked, without parsing its expressions (what the run time reports)."""
    t = read_json(path)
    kind(t, str(path))
    return dict(t.get("metrics") or {})


def load(path: str | Path) -> Table:
    """Read, validate and type one table (a path, or ``family/name`` inside the packaged data)."""
    p = resolve(path)
    return from_json(read_json(p), str(p))


def packaged_name(path: str | Path) -> str | None:
    """``family_dir/name`` of a packaged table file (what :func:`resolve` and :func:`load` accept), else None."""
    p, data = Path(path).resolve(), data_dir().resolve()
    return p.relative_to(data).with_suffix("").as_posix() if p.is_relative_to(data) else None


def table_paths(family: str | None = None) -> list[Path]:
    """All packaged tables (of one family), sorted."""
    root = data_dir()
    pattern = f"{family.replace('-', '_')}/*.json" if family else "*/*.json"
    return sorted(root.glob(pattern))


def relu_sum_name(activation: str, bits: int, objective: str, source: str = "fit", levels_rule: str = "eq13") -> str:
    """Canonical file stem, e.g. ``gelu-k2-primitive``, ``gelu-k2-primitive-paper`` or (FewBit's free levels)
    ``gelu-k2-derivative-free``."""
    stem = f"{activation}-k{bits}-{objective}" + ("-free" if levels_rule == "free" else "")
    return stem if source == "fit" else f"{stem}-paper"


@dataclass(frozen=True, eq=False)
class Table(Mapping):
    """The base of every family's table (a family subclasses it with its ``family``, ``folder`` and fields, and
    registers it in :data:`~.families.TABLE_FAMILIES`). A table is built from its JSON by :func:`from_json`
    (validated there, and nowhere else; :meth:`field_value` types each field) and keeps that JSON for :meth:`to_json`,
    so files round-trip byte for byte. It is also a read-only mapping of its JSON fields (``t["knots"]``, ``{**t}``)
    for notebooks and tests; library code reads attributes."""

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

    @classmethod
    def field_value(cls, name: str, value):
        """A validated JSON field as the attribute holds it: a list becomes a tuple (a family overrides this for its
        own fields' types)."""
        return tuple(value) if isinstance(value, list) else value

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
        return isinstance(other, Table) and self._json == other._json

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
class ReluSumTable(Table):
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
    levels_rule: str  # eq13 or free (table_schema.LEVELS_RULES); absent from an eq. 13 table's JSON

    @classmethod
    def field_value(cls, name: str, value):
        return (value or "eq13") if name == "levels_rule" else super().field_value(name, value)

    @property
    def name(self) -> str:
        return relu_sum_name(self.activation, self.bits, self.objective, self.source, self.levels_rule)

    def summary(self) -> str:
        """One line for ``approxbp tables``."""
        return f"k={self.bits} {self.objective:<10} loss={self.loss:.6e}"

    @classmethod
    def new(cls, activation, relu_sum, *, bits: int, objective: str, interval, loss: float, metrics: dict,
            provenance: dict, source: str = "fit", reference: str | None = None,
            level0: float | None = None) -> ReluSumTable:
        """A validated table from a fit's numbers: ``activation`` (its ``name`` and ``expression``), ``relu_sum``
        (:class:`~.relu_sum.ReLUSum`: weights, knots, levels, constraint residual) on ``interval`` [A, B]. With
        ``level0`` ℓ₀, FewBit's free levels (levels_rule free): h̃′ = ℓ₀ + Σ w_i [x > c_i], no eq. 13 constraints."""
        free = {} if level0 is None else {"levels_rule": "free"}
        return from_json(new_fields(cls.family, activation, source, metrics, provenance, reference) | {
            "bits": bits, "objective": objective, "interval": [float(v) for v in interval],
            "weights": relu_sum.weights.tolist(), "knots": relu_sum.knots.tolist(),
            "levels": (relu_sum.levels + (level0 or 0.0)).tolist(), "loss": loss,
            "constraint_residual": relu_sum.constraint_residual} | free)


@dataclass(frozen=True, eq=False)
class InvActTable(Table):
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

    @classmethod
    def field_value(cls, name: str, value):
        if name in ("left", "right", "combined"):
            return None if value is None else Branch.from_json(value)
        return bool(value) if name == "monotone" else super().field_value(name, value)

    @property
    def name(self) -> str:
        return f"{self.activation}-{self.form}"

    def summary(self) -> str:
        """One line for ``approxbp tables``."""
        return f"{self.form:<10} " + " ".join(f"L∞ {b} {self.metrics[f'linf_{b}']:.2e}" for b in self.branches)

    @classmethod
    def new(cls, activation, *, form: str, f_T: float, right: dict, metrics: dict, provenance: dict,
            source: str = "fit", left: dict | None = None, turning_point: float | None = None,
            combined: dict | None = None, monotone: bool = False, reference: str | None = None) -> InvActTable:
        """A validated table from a fit's numbers: ``activation`` (its ``name`` and ``expression``), the branch forms
        as their JSON (``Form.to_json(domain)``); ``monotone``: one branch (``right``), no turning point."""
        optional = {"left": left, "turning_point": turning_point, "combined": combined}
        return from_json(new_fields(cls.family, activation, source, metrics, provenance, reference) | {
            "form": form, "f_T": f_T, "variable": "y", "right": right, **({"monotone": True} if monotone else {}),
            **{k: v for k, v in optional.items() if v is not None}})

    @property
    def branches(self) -> tuple[str, ...]:
        """:func:`branches_of` this table."""
        return branches_of(self)


def new_fields(family: str, activation, source: str, metrics: dict, provenance: dict, reference: str | None = None
               ) -> dict:
    """The fields every new table has: schema, family, the activation, today's date, where it came from."""
    return {"schema": SCHEMA, "family": family, "activation": activation.name, "expression": activation.expression,
            "created": _dt.date.today().isoformat(), "source": source, "metrics": metrics, "provenance": provenance,
            **({"reference": reference} if reference else {})}


def from_json(d: dict, where: str = "<table>") -> Table:
    """Validate a table's JSON object and build its typed table: the one place tables are built."""
    d = validate(copy.deepcopy(d), where)
    cls = member(TABLE_FAMILIES, d["family"], "table class").table_class
    return cls(**{f.name: cls.field_value(f.name, d.get(f.name)) for f in fields(cls) if f.name != "_json"}, _json=d)


def is_table(obj) -> bool:
    """Whether ``obj`` is a typed table of any registered family (:data:`TABLE_FAMILIES`)."""
    return isinstance(obj, Table)


def as_table(t: Table | dict) -> Table:
    """A typed table from a table, its JSON object (validated) or a fit result holding one."""
    t = _held(t)
    return t if isinstance(t, Table) else from_json(t)


_CHECKS = "approxbp.approximations.table_checks"
_ERRORS = "approxbp.approximations.gradient_error"
register(TABLE_FAMILIES, "relu-sum", TableFamily(
    "relu-sum", ReluSumTable, lazy(_CHECKS, "validate_relu_sum"), lazy(_CHECKS, "check_relu_sum_certified"),
    lazy(_ERRORS, "relu_sum_table_error"), "E_N(0,1)[(h̃′ − f′)²]^½"))
register(TABLE_FAMILIES, "invact", TableFamily(
    "invact", InvActTable, lazy(_CHECKS, "validate_invact"), lazy(_CHECKS, "check_invact_certified"),
    lazy(_ERRORS, "invact_table_error"), "certified L∞ of f′(f⁻¹(y))"))
