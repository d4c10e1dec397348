"""Which generated Triton module serves a table, and the one place that writes a user's kernels.

Packaged tables have their modules in the package (``kernels/generated/``). A user's table gets them in
``<table folder>/_generated/``, written by ``approxbp export`` or, once, when a drop-in is constructed
(:func:`ensure_generated`, with a note on stderr). ``approxbp export --out-dir DIR`` and a drop-in's
``kernels_dir=DIR`` name another folder, the same for both. The forward and backward passes only import
(:func:`generated_module`): they never write files.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from functools import cache
from pathlib import Path

from approxbp.approximations import tables as T

from .codegen import GENERATED, export, kernel_dir, module_name


def table_file(table, family: str) -> Path:
    """A table argument as a file: a path, a packaged name, or a table (typed, or its JSON object: validated, then
    written once to the user cache, ``$XDG_CACHE_HOME/approxbp/tables``, named by its definition hash, so that its
    kernels have a home)."""
    if isinstance(table, str | Path):
        return T.resolve(table, family)
    t = T.as_table(table)
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "approxbp" / "tables"
    path = cache_dir / f"{t.family}-{t.sha256[:16]}.json"
    if not path.is_file():
        T.save(t, path)
    return path


def _target(path: Path, family: str, kernels_dir: str | Path | None = None) -> Path:
    return (Path(kernels_dir) if kernels_dir is not None else kernel_dir(path)) / f"{module_name(path, family)}.py"


def _current(target: Path, want: str) -> bool:
    return target.is_file() and f"TABLE_SHA256 = {want!r}" in target.read_text(encoding="utf-8")


def ensure_generated(table_path: str | Path, table: T.Table, kernels_dir: str | Path | None = None) -> None:
    """At drop-in construction: write a table's module into ``kernels_dir`` (None: the user table's
    ``_generated/``) when it is missing or stale; packaged tables without ``kernels_dir``: nothing."""
    path = Path(table_path)
    if kernels_dir is None and kernel_dir(path) == GENERATED:
        return
    target = _target(path, table.family, kernels_dir)
    if not _current(target, table.sha256):
        print(f"approxbp: generating Triton kernels for {path} into {target.parent}", file=sys.stderr)
        export([path], None if kernels_dir is None else Path(kernels_dir))


@cache
def generated_module(table_path: str, want: str, family: str, kernels_dir: str | None = None):
    """Import the generated module of the table at ``table_path`` whose definition hash is ``want`` (packaged, the
    user's ``_generated/``, or ``kernels_dir``); never writes."""
    path = Path(table_path)
    target = _target(path, family, kernels_dir)
    if kernels_dir is None and kernel_dir(path) == GENERATED:
        mod = importlib.import_module(f"approxbp.kernels.generated.{target.stem}")
    elif not _current(target, want):
        out = "" if kernels_dir is None else f" --out-dir {kernels_dir}"
        raise RuntimeError(f"{target} is missing or was generated from another version of {path}; run "
                           f"`approxbp export {path}{out}` (or construct the drop-in again, which generates it)")
    else:
        spec = importlib.util.spec_from_file_location(f"approxbp_user_kernels.{want[:16]}.{target.stem}", target)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    if mod.TABLE_SHA256 != want:
        raise RuntimeError(f"{mod.__file__} was generated from another version of {table_path}; "
                           "run `approxbp export`")
    return mod
