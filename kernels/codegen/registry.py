"""The build side's registry: family name → its Triton module's renderer ``(table_path, table) → source``; each
family's codegen module registers its own (the run time never reads it)."""

from __future__ import annotations

from approxbp.approximations.families import Registry

__all__ = ["RENDERERS"]

RENDERERS: Registry = Registry("approxbp.codegen")
