"""Where a table's generated module lives, and importing it: the kernels' run time reads these modules, never
writes them. Also the registry of specs (what one drop-in needs at run time), which the custom ops find by key.

Packaged tables have their modules in the package (``kernels/generated/``). A user's table gets them in
``<table folder>/_generated/``, or in the folder that ``approxbp export --out-dir DIR`` and a drop-in's
``kernels_dir=DIR`` both name. ``approxbp export`` (``kernels.codegen``, the build side) writes them; a drop-in
imports one and refuses, with the command to run, a module that is missing, stale or from an older approxbp.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
from functools import cache, cached_property
from pathlib import Path
from typing import ClassVar

from approxbp.approximations import tables as table_files
from approxbp.approximations.families import Registry

from .stock import exact_forward

__all__ = ["drop_in_classes", "drop_in_families", "FAMILIES", "FORMAT", "GENERATED", "generated_module",
           "GeneratedSpec", "kernel_dir", "module_name", "module_path", "register", "Spec", "spec_key", "spec_of",
           "SPECS"]


GENERATED = Path(__file__).parents[1] / "generated"
#: The layout of a generated module this run time reads (2: with the PyTorch twin and NAME, FAMILY; 3: with STOCK, the
#: registry name of torch's op for its expression, or None).
FORMAT = 3


def kernel_dir(table_path: str | Path) -> Path:
    """Where a table's generated module lives: the package's ``kernels/generated/`` for packaged tables,
    ``<table folder>/_generated/`` for a user's table (``approxbp export`` and the drop-ins agree on this)."""
    path = table_files.resolve(table_path)
    return GENERATED if table_files.packaged_name(path) is not None else path.resolve().parent / "_generated"


def module_name(table_path: str | Path, family: str | None = None) -> str:
    """``<family>_<stem>`` as a Python name (``family`` is read from the table when not given). A user's stem that
    is not already a Python name also gets 8 hex digits of its sha256, so ``a-b.json`` and ``a_b.json`` beside each
    other get different modules (the packaged names are distinct as they are)."""
    table_path = table_files.resolve(table_path)
    family = family or table_files.header(table_path)[0]
    stem = table_path.stem
    name = re.sub(r"\W", "_", f"{family}_{stem}")
    if kernel_dir(table_path) != GENERATED and re.sub(r"\W", "_", stem) != stem:
        name += "_" + hashlib.sha256(stem.encode()).hexdigest()[:8]
    return name


def module_path(table_path: str | Path, family: str, kernels_dir: str | Path | None = None) -> Path:
    return (Path(kernels_dir) if kernels_dir is not None else kernel_dir(table_path)) / \
        f"{module_name(table_path, family)}.py"


@cache
def _packaged_by_definition() -> dict[str, Path]:
    """definition sha256 → packaged table file."""
    return {table_files.header(p)[1]: p for p in table_files.table_paths()}


def _table_file(table, family: str) -> Path:
    """A table argument as a file: a path or a packaged name, or a table (typed, or its JSON object) with the
    definition of a packaged table. Any other table in memory has no kernels yet: it is refused with the two steps
    that give it some (save it, ``approxbp export`` it), since run time writes no files."""
    if isinstance(table, str | Path):
        return table_files.resolve(table, family)
    sha = table.sha256 if table_files.is_table(table) else table_files.definition_sha256(table)
    path = _packaged_by_definition().get(sha)
    if path is None:
        raise ValueError("this table is not a file with generated kernels: save it and export it first, "
                         "`approxbp.approximations.tables.save(table, 'my.json')` and `approxbp export my.json`, then "
                         "pass 'my.json' (the drop-ins read generated modules and write no files)")
    return path


def generated_module(table_path: str | Path, family: str, kernels_dir: str | Path | None = None):
    """The generated module of the table file at ``table_path`` (packaged, the user's ``_generated/``, or
    ``kernels_dir``), checked against the file's definition hash; never writes."""
    path = Path(table_path)
    sha = table_files.header(path, family)[1]
    return _import(str(path.resolve()), sha, family, None if kernels_dir is None else str(kernels_dir))


@cache
def _import(table_path: str, want: str, family: str, kernels_dir: str | None):
    path = Path(table_path)
    target = module_path(path, family, kernels_dir)
    out = "" if kernels_dir is None else f" --out-dir {kernels_dir}"
    fix = f"run `approxbp export {path}{out}`"
    if kernels_dir is None and kernel_dir(path) == GENERATED:
        mod = importlib.import_module(f"approxbp.kernels.generated.{target.stem}")
    elif not target.is_file():
        raise RuntimeError(f"no generated kernels for {path} at {target}; {fix}")
    else:
        _check_before_import(target, want, path, fix)
        spec = importlib.util.spec_from_file_location(f"approxbp_user_kernels.{want[:16]}.{target.stem}", target)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    if mod.TABLE_SHA256 != want:
        raise RuntimeError(f"{mod.__file__} was generated from another version of {path}; {fix}")
    if getattr(mod, "FORMAT", 1) != FORMAT:
        raise RuntimeError(f"{mod.__file__} was generated by an older approxbp; {fix}")
    return mod


def _constants(target: Path) -> dict:
    """The module-level ``NAME = literal`` assignments of a generated module, read from its text without running
    it (an unreadable or unparsable file has none)."""
    try:
        tree = ast.parse(target.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return {}
    return {node.targets[0].id: node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)}


def _check_before_import(target: Path, want: str, table: Path, fix: str) -> None:
    """A user's generated module is imported (run) only once its text says it was generated, by this approxbp's
    format, from this very table definition: a file that merely sits where kernels are looked for never runs."""
    found = _constants(target)
    if found.get("TABLE_SHA256") != want:
        raise RuntimeError(f"{target} was generated from another version of {table}, or not by approxbp (its "
                           f"TABLE_SHA256, read without running it, does not match); {fix}")
    if found.get("FORMAT", 1) != FORMAT:
        raise RuntimeError(f"{target} was generated by an older approxbp; {fix}")


#: key → spec, for the custom ops (which receive the key, a string, never the spec)
SPECS: dict[str, Spec] = {}
#: family name → spec class, filled by :meth:`Spec.__init_subclass__`: a new family registers itself here (another
#: package's family: its entry point in ``approxbp.kernels``, :class:`~approxbp.approximations.families.Registry`)
FAMILIES: Registry = Registry("approxbp.kernels")


def drop_in_families() -> tuple[str, ...]:
    """The table families whose spec has a drop-in activation module: ``patch_model(family=…)``'s choices."""
    return tuple(f for f, spec in FAMILIES.items() if hasattr(spec, "drop_in"))


def drop_in_classes() -> tuple[type, ...]:
    """Every registered family's drop-in activation class with its subclasses (``ReGELU2``, ``InvActGELU``, …): what
    ``patch_model`` leaves as it is and the planner counts as ours."""
    def with_subclasses(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in with_subclasses(sub))]

    return tuple(c for f in drop_in_families() for c in with_subclasses(FAMILIES[f].drop_in))


class Spec:
    """Base of every spec: a class with a ``family`` attribute registers itself in :data:`FAMILIES`, so that
    :func:`spec_of` can rebuild one of its specs from a key (``family:rest``) with :meth:`from_key`. A spec is
    immutable and shared: a deep copy is the spec itself."""

    family: str
    key: str
    #: the planner's options for this family (``approxbp plan``'s per-layer choices): option name → bits, for the
    #: family's ``packaged`` table; none for a spec the planner does not weigh (the fused GLU is its own option)
    plan_options: ClassVar[dict[str, int]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            FAMILIES[cls.family] = cls

    @classmethod
    def from_key(cls, rest: str) -> Spec:
        """The spec whose key is ``f"{cls.family}:{rest}"``."""
        raise NotImplementedError

    def __deepcopy__(self, memo):
        return self


def register(spec: Spec) -> str:
    """Make ``spec`` reachable from the ops; returns its key."""
    SPECS[spec.key] = spec  # equal keys are equal definitions: the latest (whose module surely exists) serves
    return spec.key


def spec_of(key: str) -> Spec:
    """The spec registered under ``key``, or rebuilt from it (and registered) in a process that never built it,
    e.g. one that runs a ``torch.export``ed program (refused when the table changed since the key was made)."""
    spec = SPECS.get(key)
    if spec is None:
        family, _, rest = key.partition(":")
        if family not in FAMILIES:
            raise KeyError(f"no spec family {family!r} (key {key!r}); known: {', '.join(sorted(FAMILIES))}")
        spec = FAMILIES[family].from_key(rest)
        register(spec)
    return spec


def spec_key(family: str, sha256: str, path, kernels_dir: str | None) -> str:
    """``family:definition-sha256:source[@kernels_dir]``, where source is the packaged table's name or the user
    table's absolute path: any process can rebuild the spec from it (:func:`spec_of`)."""
    source = table_files.packaged_name(path) or str(Path(path).resolve())
    return f"{family}:{sha256}:{_escape(source)}" + (f"@{_escape(kernels_dir)}" if kernels_dir else "")


def _escape(text: str) -> str:
    """``%`` and ``@`` percent-encoded, so that ``@`` in a key only ever separates the kernels folder."""
    return text.replace("%", "%25").replace("@", "%40")


def _unescape(text: str) -> str:
    return text.replace("%40", "@").replace("%25", "%")


class GeneratedSpec(Spec):
    """What the table-driven specs share: the table file, its generated module (imported here, once), its
    definition hash and the custom ops' key. A pickle holds only where the table and the kernels are."""

    def __init__(self, table, kernels_dir: str | Path | None = None):
        self.path = _table_file(table, self.family)
        self.kernels_dir = None if kernels_dir is None else str(Path(kernels_dir).resolve())
        self.module = generated_module(self.path, self.family, self.kernels_dir)
        self.sha256, self.expression = self.module.TABLE_SHA256, self.module.EXPRESSION
        self.key = spec_key(self.family, self.sha256, self.path, self.kernels_dir)

    @classmethod
    def from_key(cls, rest: str) -> GeneratedSpec:
        sha, _, source = rest.partition(":")
        source, _, kernels_dir = source.partition("@")
        source = _unescape(source)
        spec = cls(source, _unescape(kernels_dir) or None)
        if spec.sha256 != sha:
            raise RuntimeError(f"this program was made with {source} of definition sha256 {sha[:16]}…; that table "
                               f"is now {spec.sha256[:16]}…: export the program again")
        return spec

    #: the family's drop-in ``nn.Module`` (built from a table), set by the family's module after it defines it
    drop_in: ClassVar[type]

    @staticmethod
    def packaged(activation: str, bits: int) -> str:
        """The packaged table of ``activation`` that ``patch_model(family=…)`` uses for this family."""
        raise NotImplementedError

    def error_said(self) -> str:
        """The drop-in's gradient error with its meaning (``gradient_error.describe``), without the build side."""
        raise NotImplementedError

    @cached_property
    def table(self):
        """The typed table (validated on first use, which parses its expressions; the run time never reads it)."""
        return table_files.load(self.path)

    def forward_only_torch(self, x):
        """y = h(x) with nothing saved (no gradient wanted; ``patch_model`` checks each drop-in against the stock
        module with it): torch's own op where it has one (:mod:`.stock`), else the generated twin's y, bit for bit."""
        return exact_forward(self.module, x)

    def name(self) -> str:
        """The table's canonical name (``gelu-k2-primitive``, ``gelu-fast``; "-paper" tables say so)."""
        return self.module.NAME

    def __reduce__(self):
        return _unpickle, (type(self), str(self.path), self.kernels_dir, self.sha256)


def _unpickle(cls, path: str, kernels_dir: str | None, sha256: str | None = None):
    """A pickled spec, rebuilt from its table file, which must still hold the definition it was pickled with."""
    spec = cls(path, kernels_dir)
    if sha256 is not None and spec.sha256 != sha256:
        raise RuntimeError(f"this object was saved with {path} of definition sha256 {sha256[:16]}…; that table now "
                           f"holds {spec.sha256[:16]}… (another table): restore the table file it was saved with, or "
                           "rebuild the model's drop-ins from the new table")
    return spec
