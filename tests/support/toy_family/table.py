"""The toy family's table: h̃′(x) = a for x < 0, b for x ≥ 0, fitted on [A, B] (fields ``interval``, ``levels``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from approxbp.approximations import tables as table_files
from approxbp.approximations.families import TABLE_FAMILIES, TableFamily, register
from approxbp.approximations.table_schema import fail

FAMILY = "toy-step"


@dataclass(frozen=True, eq=False)
class ToyStepTable(table_files.Table):
    family: ClassVar[str] = FAMILY
    folder: ClassVar[str] = "toy_step"
    interval: tuple
    levels: tuple

    @property
    def name(self) -> str:
        return f"{self.activation}-step"

    def summary(self) -> str:
        return f"levels {self.levels[0]:.6f} {self.levels[1]:.6f}"

    @classmethod
    def new(cls, activation, *, interval, levels, provenance: dict) -> ToyStepTable:
        return table_files.from_json(table_files.new_fields(cls.family, activation, "fit", {}, provenance)
                           | {"interval": [float(v) for v in interval], "levels": [float(v) for v in levels]})


def validate(t: dict, where: str) -> None:
    for name in ("interval", "levels"):
        v = t.get(name)
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(e, float) and math.isfinite(e) for e in v)):
            fail(where, name, "must be two finite floats")
    if not t["interval"][0] < 0.0 < t["interval"][1]:
        fail(where, "interval", "must hold 0 inside: A < 0 < B")


def check_certified(t: dict, where: str) -> None:
    c = t["metrics"]["certified"]
    if not (isinstance(c, dict) and isinstance(c.get("levels"), list) and len(c["levels"]) == 2):
        fail(where, "metrics.certified", "must hold the two levels' enclosures")


def gradient_error(t) -> float:
    """E_N(0,1)[(h̃′ − f′)²]^½: the ReLU-sum error of one knot at 0 (the same step function)."""
    from approxbp.approximations.activations import get_activation
    from approxbp.approximations.gradient_error import relu_sum_error

    return relu_sum_error((0.0,), t.levels, get_activation(t.expression).df)


register(TABLE_FAMILIES, FAMILY, TableFamily(FAMILY, ToyStepTable, validate, check_certified, gradient_error,
                                             "E_N(0,1)[(h̃′ − f′)²]^½"))
