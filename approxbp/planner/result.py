"""A plan, what ``approxbp plan`` returns, and the one place its JSON is written (:meth:`Plan.to_json`, ``--out``) and
read (:func:`read_plan`: :meth:`Plan.load`, ``--use plan.json``); applying it to a model (:meth:`Plan.apply`, through
:func:`plan_config`: the plan's layers matched to the model's activation modules). Its report: :mod:`~.report`."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from approxbp.kernels.rewrite.common import PatchConfig

from approxbp.approximations import tables as table_files
from approxbp.planner.plan_parts import Moves, MsNorm, PlannedLayer, StepSummary
from approxbp.planner.step_memory import weight_shapes

__all__ = ["MAX_PLAN_BYTES", "OptionCost", "Plan", "PLAN_SCHEMA", "plan_config", "planned_layers", "read_plan",
           "unapplied"]

#: The plan JSON's version, written as ``"schema"``: 1 is the first that carries it (0.2's files, which have none,
#: read as it); 2 names the chunked loss in ``moves["chunked_loss"]["chosen"]`` (1 had a ``"(loss)"`` key among the
#: blocks' moves: read as 2) and carries ``shard``. A file of a later version is refused by name rather than misread.
PLAN_SCHEMA = 2
_SCHEMA_1_LOSS = "(loss)"


@dataclass(frozen=True)
class OptionCost:
    """What one option of one activation costs, measured: the bytes it takes off the step's peak per layer (every
    layer of that activation given the option, divided by their count) and the gradient error its backward makes
    (:mod:`approxbp.approximations.gradient_error`; 0 for exact and the fused GLU). In the JSON: its two fields."""

    saving_per_layer: int
    error: float


@dataclass(kw_only=True)
class Plan:
    model: str
    mode: str
    batch: int
    seq: int | None  # None: the model's inputs do not depend on it
    budget: int | None
    before: StepSummary
    after: StepSummary
    layers: dict[str, PlannedLayer]  # module path → its activation, option, table and the option's cost
    options: dict[str, dict[str, OptionCost]]  # activation → option → its measured cost
    ms_norm: MsNorm
    estimate: int | None = None  # the knapsack's additive prediction of the peak; ``after`` is measured
    checkpoint: bool = False  # activation checkpointing
    shard: int = 1  # FSDP ranks the model is sharded over: the peaks are one rank's (schema 1: read off ``mode``)
    traced: bool = False  # a whole step traced (MemTracker) rather than the forward's saved tensors
    use: str | None = None  # the assignment evaluated (--use), or None: chosen by the planner
    moves: Moves | None = None  # recompute/offload moves beyond the approximations (planner.plan_moves.plan_moves)
    assignment: StepSummary | None = None  # with moves: the approximations' step alone (``after`` is the final one)
    schema: int = PLAN_SCHEMA  # the JSON's version (:data:`PLAN_SCHEMA`)
    weights: str | None = None  # the planned model's weight shapes (:func:`weight_shapes`); None: not recorded

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan ``approxbp plan --out`` wrote to ``path`` (refused in one line when it is not one)."""
        data = read_plan(str(path))
        if missing := [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]:
            raise ValueError(f"{path}: not a plan written by `approxbp plan --out` (no {', '.join(missing)})")
        try:
            options = {act: {o: OptionCost(**cost) for o, cost in opts.items()}
                       for act, opts in data["options"].items()}
        except (AttributeError, TypeError) as err:
            raise ValueError(f"{path}: 'options' must map each activation to {{option: {{'saving_per_layer', "
                             f"'error'}}}}, as `approxbp plan --out` writes it ({err})") from None
        try:
            typed = {"options": options, "layers": {p: PlannedLayer.from_json(v) for p, v in data["layers"].items()},
                     "ms_norm": MsNorm.from_json(data["ms_norm"]), "moves": Moves.from_json(data.get("moves")),
                     **{k: None if data.get(k) is None else StepSummary.from_json(data[k])
                        for k in ("before", "after", "assignment")}}
        except (AttributeError, TypeError) as err:
            raise ValueError(f"{path}: not a plan written by `approxbp plan --out` ({err})") from None
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data} | typed)

    def apply(self, model: nn.Module, *, example_input=None, check: bool = True,
              module_filter_fn: Callable[[nn.Module, str], bool] | None = None, compile_backend="inductor"):
        """Patch ``model`` as planned: each planned layer's table (or exact), the gated MLPs of its ``glu`` layers
        fused, MS-norms as chosen (:func:`approxbp.kernels.patch_model`'s rules and proofs; the plan's paths match
        the model's as they are or as a suffix, so a peft-wrapped model takes its base model's plan), then its moves;
        a planned ``activation_memory_budget`` compiles the model in place with ``compile_backend`` at that budget
        (:func:`~.compiled.budget_backend`). Returns the patch report; without ``example_input`` the planned
        fused GLUs are not applied, and it says so per layer."""
        from approxbp.kernels.rewrite.patch import patch_model

        self.check_model(model)
        config = plan_config(self, model)
        report = patch_model(model, config=replace(config, module_filter_fn=module_filter_fn),
                             example_input=example_input, check=check)
        if missed := unapplied(config, report):
            warnings.warn("the plan and its application disagree (the planned peak does not hold): "
                          + "; ".join(missed), stacklevel=2)
        if self.moves is not None and self.moves.compile is not None:
            from approxbp.planner.compiled import budget_backend

            b = self.moves.compile.activation_memory_budget
            model.compile(backend=budget_backend(b, compile_backend))
            report.moves = [f"compiled in place, activation_memory_budget {b}"]
        elif self.moves:
            report.moves = self._apply_moves(model)
        return report

    def check_model(self, model: nn.Module) -> None:
        """Refuse ``model`` when its weight shapes are not the planned model's (a plan's layer paths alone match any
        model of the same architecture: a hidden-128 model would take a hidden-32 plan and its budget)."""
        if self.weights is not None and (here := weight_shapes(model)) != self.weights:
            raise ValueError(f"this plan was made for another model: planned weights {self.weights}, this model's "
                             f"{here}; plan this model (`approxbp plan` on its config, or ApproxBPCallback(budget=…))")

    def _apply_moves(self, model: nn.Module) -> list[str]:
        """The planned recompute/offload moves on ``model``'s blocks (a planned path matches as it is or as a suffix,
        as the layers do) and the chunked loss where chosen; a block the model lacks is refused in one line."""
        from approxbp.planner.moves import apply_moves

        paths = [n for n, _ in model.named_modules()]
        resolved = {}
        for planned, move in self.moves.moves.items():
            found = [p for p in paths if p == planned or p.endswith("." + planned)]
            if len(found) != 1:
                raise ValueError(f"the plan moves block {planned!r}, which this model has {len(found)} times, not once")
            resolved[found[0]] = move
        chunked = self.chunked_loss
        apply_moves(model, resolved, chunked_loss=chunked)
        return [f"{path}: {move}" for path, move in resolved.items()] + ["the loss: chunked"] * chunked

    @property
    def chunked_loss(self) -> bool:
        """Whether the plan chunks the loss (one of its moves)."""
        return self.moves is not None and self.moves.chunks_loss


def unapplied(config: PatchConfig, report) -> list[str]:
    """Each rewrite ``config`` plans that ``report`` did not make, with the reason the report gives: a planned table
    or fused GLU skipped (its proof failed, or it saved nothing on the example), or MS-norms planned and none merged."""
    done = report.rewritten()
    planned = [p for p, t in (config.tables or {}).items() if t != "exact" and p.rpartition(".")[0] not in config.glu]
    missed = []
    for path in [*planned, *sorted(config.glu)]:
        if path not in done:
            why = [s for s in report.skipped if s.startswith(path + " ") or s.startswith(path + ":")]
            missed.append(why[0] if why else f"{path}: not rewritten")
    if config.norms and not report.norms:
        missed.append("MS-norms planned, none merged")
    return missed


def read_plan(plan) -> dict:
    """A plan (JSON file path or its dict), its schema version (:data:`PLAN_SCHEMA`; none: 0.2's, read as 1) and its
    ``layers`` and ``ms_norm`` checked field by field."""
    where = "plan" if isinstance(plan, dict) else str(plan)
    if not isinstance(plan, dict):
        try:
            size = Path(plan).stat().st_size
            if size > MAX_PLAN_BYTES:
                raise ValueError(f"{where}: {size} bytes; a plan file is at most {MAX_PLAN_BYTES} bytes (refused "
                                 "unread)")
            plan = json.loads(Path(plan).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"{where}: not a readable plan JSON file ({type(err).__name__}: "
                             f"{str(err)[:200]})") from None
    if not isinstance(plan, dict):
        raise ValueError(f"{where}: a plan is a JSON object, got {type(plan).__name__}")
    if _depth(plan) > _MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {_MAX_DEPTH} levels deep; a plan nests at most {_MAX_DEPTH}")
    version = plan.get("schema", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: 'schema' must be an integer ≥ 1 (this approxbp writes {PLAN_SCHEMA}), got "
                         f"{version!r}")
    if version > PLAN_SCHEMA:
        raise ValueError(f"{where}: a plan of schema {version!r}, written by a newer approxbp; this one reads plan "
                         f"schema {PLAN_SCHEMA} and earlier: upgrade approxbp, or plan again with this version")
    if version < 2:
        plan = _from_schema_1(plan)
    _check_fields(plan, where)
    layers, ms = (plan.get("layers"), plan.get("ms_norm")) if isinstance(plan, dict) else (None, None)
    if not isinstance(layers, dict) or not all(isinstance(v, dict) and isinstance(v.get("table"), str | None)
                                               for v in layers.values()):
        raise ValueError(f"{where}: 'layers' must map module paths to {{'table': a table name or null, …}}, as "
                         "`approxbp plan --out` writes it")
    if not isinstance(ms, dict) or not isinstance(ms.get("chosen"), bool):
        raise ValueError(f"{where}: 'ms_norm' must be {{'chosen': true or false, …}}, as `approxbp plan --out` "
                         "writes it")
    return plan


#: A plan file's size cap (what `approxbp plan --out` writes is a few KiB; a model of 1 000 layers ~1 MiB).
MAX_PLAN_BYTES = 16 * 2**20
#: How deep a plan's JSON may nest (it writes 4 levels).
_MAX_DEPTH = 16


def _depth(value, limit: int = _MAX_DEPTH + 1) -> int:
    """How deep ``value`` nests (counted up to ``limit``, no recursion: a hostile file cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d < limit and isinstance(v, dict | list):
            stack += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, dict | list)]
    return deepest


def _count(v) -> bool:
    """An integer ≥ 1 (JSON's true is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check_fields(plan: dict, where: str) -> None:
    """Each field a plan's reader uses, by type and range: a refusal names the field and the value."""
    def refuse(field: str, value, want: str):
        raise ValueError(f"{where}: {field!r} must be {want}, got {value!r}")

    for field, want in (("batch", "an integer ≥ 1"), ("seq", "an integer ≥ 1 or null"),
                        ("budget", "bytes, an integer ≥ 1, or null"), ("shard", "an integer ≥ 1")):
        if field in plan and not (_count(plan[field]) or "null" in want and plan[field] is None):
            refuse(field, plan[field], want)
    for field, kind, want in (("weights", str, "a string (as `approxbp plan --out` writes it) or null"),):
        if plan.get(field) is not None and not isinstance(plan[field], kind):
            refuse(field, plan[field], want)
    for flag in ("checkpoint", "traced"):
        if flag in plan and not isinstance(plan[flag], bool):
            refuse(flag, plan[flag], "true or false")
    moves = plan.get("moves")
    if moves is None:
        return
    if not isinstance(moves, dict):
        refuse("moves", moves, "an object ({'moves': {block path: move}, 'chunked_loss': …}) or null")
    blocks = moves.get("moves", {})
    if not isinstance(blocks, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in blocks.items()):
        refuse("moves.moves", blocks, "an object of block path → move name")
    loss = moves.get("chunked_loss")
    if loss is not None and not (isinstance(loss, dict) and isinstance(loss.get("chosen"), bool)):
        refuse("moves.chunked_loss", loss, "null or {'chosen': true or false, …}")


def _from_schema_1(plan: dict) -> dict:
    """A schema-1 (or 0.2) plan as schema 2 (a copy: the caller's dict is not changed): its ``"(loss)"`` entry among
    the blocks' moves becomes ``moves["chunked_loss"]["chosen"]``, and its mode's "sharded over N" ``shard``."""
    sharded = re.search(r"sharded over (\d+)", str(plan.get("mode", "")))  # schema 1 said it in words only
    plan = {**plan, "schema": 2, **({"shard": int(sharded[1])} if sharded else {})}
    moves = plan.get("moves")
    if not isinstance(moves, dict) or not isinstance(moves.get("moves"), dict):
        return plan
    blocks = dict(moves["moves"])
    chunked = blocks.pop(_SCHEMA_1_LOSS, "keep") == "chunked-loss"
    cost = moves.get("chunked_loss")
    loss = None if cost is None and not chunked else {"chosen": chunked, **(cost or {})}
    return {**plan, "moves": {**moves, "moves": blocks, "chunked_loss": loss}}


def planned_layers(plan) -> tuple[dict[str, PlannedLayer], MsNorm]:
    """A plan's layers (module path → :class:`~.plan_parts.PlannedLayer`) and MS-norms: of a :class:`Plan`, or of its
    JSON file or dict (:func:`read_plan`, each field checked before it is typed)."""
    if isinstance(plan, Plan):
        return plan.layers, plan.ms_norm
    data = read_plan(plan)
    return {p: PlannedLayer.from_json(v) for p, v in data["layers"].items()}, MsNorm.from_json(data["ms_norm"])


def plan_config(plan, model: nn.Module) -> PatchConfig:
    """An ``approxbp plan`` (a :class:`Plan`, or its JSON file or dict, :func:`read_plan`) → the patch that applies it
    to ``model``: tables {module path in ``model``: table path or "exact"}, MS-norms on or off, the gated MLPs to fuse
    (the parents of the layers whose option is ``glu``).
    The plan's layer paths are matched to the model's activation modules as they are or as a suffix (peft wraps
    the planned model as ``base_model.model.…``); each must match exactly one, and every activation of the model
    must be in the plan, else it was made for another model and is refused."""
    from approxbp.kernels.rewrite.activation_swap import ACTIVATION_CLASSES, class_key
    from approxbp.kernels.rewrite.common import PatchConfig

    where = "plan" if isinstance(plan, dict | Plan) else str(plan)
    layers, ms = planned_layers(plan)
    ours = [n for n, m in model.named_modules() if class_key(m) in ACTIVATION_CLASSES]
    chosen, unmatched, fused = {}, [], set()
    for path, layer in layers.items():
        hits = [n for n in ours if n == path or n.endswith("." + path)]
        if len(hits) != 1:
            unmatched.append(f"{path} ({'no' if not hits else len(hits)} matching activation modules)")
            continue
        chosen[hits[0]] = table_files.resolve(layer.table) if layer.table else "exact"
        if layer.option == "glu":
            fused.add(hits[0].rpartition(".")[0])
    missing = [n for n in ours if n not in chosen]
    if unmatched or missing:
        raise ValueError(f"{where} was made for another model: {len(layers)} planned layers, {len(ours)} activation "
                         f"modules here; unmatched in the plan: {unmatched[:3]}; not in the plan: {missing[:3]}")
    return PatchConfig(family=None, tables=chosen, norms=ms.chosen, glu=fused)
