"""Generate Triton modules from coefficient tables (``approxbp export``): the build side of the kernels, never
imported by their run time. One module per concern: :mod:`.printer` (sympy → Triton), :mod:`.helpers` (the shared
Triton helpers, ``generated/triton_helpers.py``), :mod:`.twins` (the PyTorch twins and the header every generated
module starts with), and one per family: :mod:`.relu_sum`, :mod:`.invact`, :mod:`.glu`, :mod:`.reference`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from approxbp.approximations import tables as table_files
from approxbp.approximations.families import TABLE_FAMILIES
from approxbp.approximations.files import write_atomic

from ..ops.glu import GLU_ACTIVATIONS
from ..ops.modules import module_path
from .glu import glu_module_path, render_glu
from .helpers import HELPERS_MODULE, render_helpers
from .invact import render_invact
from .printer import lower, triton_source
from .reference import REFERENCE_ACTIVATIONS, reference_module_path, render_reference
from .registry import RENDERERS
from .relu_sum import render_relu_sum
from .twins import activation_twin

__all__ = ["export", "export_if_stale", "render", "render_relu_sum", "render_invact", "render_glu",
           "render_reference", "REFERENCE_ACTIVATIONS", "reference_module_path", "render_helpers", "glu_module_path",
           "triton_source", "lower", "activation_twin", "HELPERS_MODULE", "GLU_ACTIVATIONS", "RENDERERS"]


def render(table_path: Path, t: dict | None = None) -> str:
    """The Triton module of a table of any registered family (its renderer, :data:`RENDERERS`)."""
    from approxbp.approximations.families import member

    t = t or table_files.load(table_path)
    return member(RENDERERS, t.family, "Triton renderer")(table_path, t)


def export(tables: list[Path] | None = None, out_dir: Path | None = None) -> list[Path]:
    """(Re)generate a Triton module per table (every packaged table by default) into ``out_dir`` or
    :func:`~approxbp.kernels.ops.modules.kernel_dir`; returns the written paths."""
    written = []
    if not tables and out_dir is None:  # the packaged set: the shared helpers, the GLU and reference modules too
        from approxbp.approximations import get_activation

        write_atomic(HELPERS_MODULE, render_helpers())
        written.append(HELPERS_MODULE)
        for activation in GLU_ACTIVATIONS:
            write_atomic(glu_module_path(activation), render_glu(activation))
            written.append(glu_module_path(activation))
        for activation in REFERENCE_ACTIVATIONS:
            write_atomic(reference_module_path(activation), render_reference(get_activation(activation)))
            written.append(reference_module_path(activation))
    for p in tables or [q for family in TABLE_FAMILIES for q in table_files.table_paths(family)]:
        t = table_files.load(p)
        target = module_path(p, t.family, out_dir)
        write_atomic(target, render(Path(p), t))
        written.append(target)
    return written


def export_if_stale(table_path: Path, out_dir: Path | None = None) -> Path | None:
    """Export one table unless its module is already there and current (a note on stderr when it writes);
    returns the written path, or None."""
    from ..ops.modules import generated_module

    try:
        generated_module(table_path, table_files.header(table_path)[0], out_dir)
        return None
    except RuntimeError:
        target = export([Path(table_path)], out_dir)[0]
        print(f"approxbp: generated Triton kernels for {table_path} into {target.parent}", file=sys.stderr)
        return target
