"""A plan written by ``approxbp plan --out`` matched to a model: the per-layer choices that
``approxbp.plan.Plan.apply`` hands to :func:`~.patch.patch_model`."""

from __future__ import annotations

import json
from pathlib import Path

from approxbp.approximations import tables as T
from torch import nn

from .activation_swap import ACTIVATION_CLASSES, class_key
from .common import PatchConfig


def read_plan(plan) -> dict:
    """A plan (JSON file path or its dict), its ``layers`` and ``ms_norm`` checked field by field."""
    where = "plan" if isinstance(plan, dict) else str(plan)
    if not isinstance(plan, dict):
        try:
            plan = json.loads(Path(plan).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{where}: not a readable plan JSON file ({err})") from None
    layers, ms = (plan.get("layers"), plan.get("ms_norm")) if isinstance(plan, dict) else (None, None)
    if not isinstance(layers, dict) or not all(isinstance(v, dict) and isinstance(v.get("table"), str | None)
                                               for v in layers.values()):
        raise ValueError(f"{where}: 'layers' must map module paths to {{'table': a table name or null, …}}, as "
                         "`approxbp plan --out` writes it")
    if not isinstance(ms, dict) or not isinstance(ms.get("chosen"), bool):
        raise ValueError(f"{where}: 'ms_norm' must be {{'chosen': true or false, …}}, as `approxbp plan --out` "
                         "writes it")
    return plan


def plan_config(plan, model: nn.Module) -> PatchConfig:
    """An ``approxbp plan`` (JSON file or dict, :func:`read_plan`) → the patch that applies it to ``model``: tables
    {module path in ``model``: table path or "exact"}, MS-norms on or off, the gated MLPs to fuse (the parents of the
    layers whose option is ``glu``).
    The plan's layer paths are matched to the model's activation modules as they are or as a suffix (peft wraps
    the planned model as ``base_model.model.…``); each must match exactly one, and every activation of the model
    must be in the plan, else it was made for another model and is refused."""
    where = "plan" if isinstance(plan, dict) else str(plan)
    plan = read_plan(plan)
    layers, ms = plan["layers"], plan["ms_norm"]
    ours = [n for n, m in model.named_modules() if class_key(m) in ACTIVATION_CLASSES]
    chosen, unmatched, fused = {}, [], set()
    for path, layer in layers.items():
        hits = [n for n in ours if n == path or n.endswith("." + path)]
        if len(hits) != 1:
            unmatched.append(f"{path} ({'no' if not hits else len(hits)} matching activation modules)")
            continue
        chosen[hits[0]] = T.resolve(layer["table"]) if layer["table"] else "exact"
        if layer.get("option") == "glu":
            fused.add(hits[0].rpartition(".")[0])
    missing = [n for n in ours if n not in chosen]
    if unmatched or missing:
        raise ValueError(f"{where} was made for another model: {len(layers)} planned layers, {len(ours)} activation "
                         f"modules here; unmatched in the plan: {unmatched[:3]}; not in the plan: {missing[:3]}")
    return PatchConfig(family=None, tables=chosen, norms=ms["chosen"], glu=fused)
