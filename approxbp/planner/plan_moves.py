"""``approxbp plan --budget … --gpu …`` beyond the approximations: when the least-error assignment cannot
reach the budget, the most-saving one is taken (the approximations cost no modelled time: their kernels move fewer
bytes than the exact ones) and blocks are recomputed or offloaded (:mod:`~.moves`) at the least modelled step
time (:mod:`approxbp.planner.step_time`, a roofline for the named GPU on fake tensors). The peak is modelled from the
measured step: its end-of-forward bytes less each move's saving, plus the largest moved block's bytes (the one
block a recompute rebuilds, or an offload brings back, at a time)."""

from __future__ import annotations

from typing import NamedTuple

from approxbp.planner.chunked_loss import CHUNKED, NotChunked, chunk_rows
from approxbp.planner.extrapolate import SMALL, layer_count, shrunk, small_assignment
from approxbp.planner.gpus import GPU
from approxbp.planner.models import hf_builder, model_spec, no_init
from approxbp.planner.moves import RECOMPUTE_PART, BlockCost, LossCost, choose_moves
from approxbp.planner.plan_parts import ChunkedLossCost, Moves
from approxbp.planner.plan_step import _fake_like_real, apply, seeded
from approxbp.planner.request import Request
from approxbp.planner.step_memory import StepMemory, first_block, prepare
from approxbp.planner.step_time import Roofline, StepTime, block_paths, drop_in_paths
from approxbp.planner.training import weights_for

__all__ = ["Assignment", "block_costs", "fastest", "modelled_time", "move_costs", "plan_moves", "time_step", "timed",
           "Weighed"]


class Assignment(NamedTuple):
    """An assignment of the approximations with its measured step, additive estimate and gradient-error bound."""

    choice: dict[str, str]  # activation layer path → its option
    after: StepMemory
    estimate: int
    ms_norm: bool
    error: float


class Weighed(NamedTuple):
    """An :class:`Assignment` with what its moves cost (:func:`move_costs`)."""

    assignment: Assignment
    time: StepTime
    blocks: int
    loss: LossCost | None
    parts: dict  # a block's part → the bytes recomputing it alone takes off, per block (measured)


def fastest(weighed: list[Weighed], budget: int, device: GPU, itemsize: int) -> tuple[Weighed, Moves] | None:
    """The assignment and moves reaching ``budget`` in the least modelled step time, the approximations and the moves
    chosen jointly (ties: the least gradient-error bound); None when no assignment's moves reach it."""
    best = None
    for w in weighed:
        try:
            moved = plan_moves(w.assignment.after, w.time, w.blocks, budget, device, itemsize, w.loss, w.parts)
        except ValueError:
            continue
        if best is None or (moved.seconds_after, w.assignment.error) < (best[1].seconds_after,
                                                                       best[0].assignment.error):
            best = (w, moved)
    return best


def time_step(model, inputs: dict, setup, device: GPU) -> StepTime:
    """The roofline of one training step of ``model`` (forward under the set-up's autocast, then backward), charged
    to its blocks; on fake tensors inside the caller's fake mode."""
    from approxbp.planner.step_memory import _autocast, _loss_of

    blocks = block_paths(model, first_block(model))
    modules = dict(model.named_modules())
    parts = [f"{b}.{name}" for b in blocks for name, _ in modules[b].named_children()]
    clock = Roofline(device, type(model).__name__, blocks, drop_in_paths(model), parts=parts)
    with clock, _autocast(setup):
        loss = _loss_of(model(**inputs))
    with clock:
        loss.backward()
    return clock.time


def block_costs(step: StepMemory, time: StepTime, bytes_per_element: int,
                parts: dict[str, int] | None = None) -> dict[str, BlockCost]:
    """Each block's measured bytes and modelled seconds: S_b from the step's bytes charged to its modules, I_b its
    input hidden state, F_b and B_b the roofline's (a block the timing model did not have takes block 1's); each
    part of ``parts`` (name → measured saving per block) with its forward time."""
    prefix = step.block.rpartition(".")[0] + "." if step.block else ""
    if not prefix:
        return {}
    saved: dict[str, int] = {}
    for path, b in step.saved.items():
        if path.startswith(prefix):
            index = path[len(prefix):].split(".")[0]
            saved[prefix + index] = saved.get(prefix + index, 0) + b
    stand_in = prefix + "1"

    def part_time(path: str, name: str) -> float:
        return time.parts.get(f"{path}.{name}", time.parts.get(f"{stand_in}.{name}", 0.0))

    return {path: BlockCost(s, step.block_input * bytes_per_element,
                            time.forward.get(path, time.forward.get(stand_in, 0.0)),
                            time.backward.get(path, time.backward.get(stand_in, 0.0)),
                            tuple((name, saving, part_time(path, name)) for name, saving in (parts or {}).items()))
            for path, s in saved.items()}


def modelled_time(time: StepTime, blocks: int) -> float:
    """The whole step's modelled seconds from a timing at fewer alike blocks (block 1's time for each)."""
    timed_blocks = [p for p in time.forward if p]
    if not timed_blocks or len(timed_blocks) == blocks:
        return time.total
    one = next((p for p in timed_blocks if p.endswith(".1")), timed_blocks[0])
    outside = time.forward.get("", 0.0) + time.backward.get("", 0.0)
    return outside + blocks * (time.forward[one] + time.backward.get(one, 0.0))


def plan_moves(step: StepMemory, time: StepTime, blocks: int, budget: int, device: GPU,
               bytes_per_element: int, loss: LossCost | None = None, parts: dict[str, int] | None = None) -> Moves:
    """The :class:`~.plan_parts.Moves` of least modelled time that bring the step's peak to ``budget`` (see the module
    docstring): the blocks' moves, the modelled peak and its parts, the modelled seconds before and after, and the
    chunked loss's cost with whether it is chosen (None where the model's loss cannot be chunked). ``loss``: the
    chunked loss's measured cost, an item of the knapsack beside the blocks; ``parts``: the blocks' parts
    recomputable alone, with their measured saving per block."""
    costs = block_costs(step, time, bytes_per_element, parts)
    chosen, chunked = choose_moves(costs, step.peak - budget, device.host_link, loss)
    taken = sum(costs[p].saving(m) for p, m in chosen.items()) + (loss.takes if chunked else 0)
    transient = max([costs[p].saved for p in chosen] + ([loss.saved] if chunked else []), default=0)
    base = modelled_time(time, blocks)
    extra = sum(costs[p].seconds(m, device.host_link) for p, m in chosen.items()) + (loss.extra if chunked else 0.0)
    return Moves(moves=chosen, gpu=device.name, gpu_source=device.source, end_of_forward=step.peak - taken,
                 transient=transient, peak=step.peak - taken + transient, seconds_before=base,
                 seconds_after=base + extra,
                 by_move={**{m: sum(1 for v in chosen.values() if v == m) for m in ("recompute", "offload")},
                          CHUNKED: int(chunked),
                          "recompute part": sum(1 for v in chosen.values() if v.startswith(RECOMPUTE_PART))},
                 chunked_loss=None if loss is None else ChunkedLossCost(chunked, loss.takes, loss.saved, loss.extra))


def timed(request: Request, device, assignment: dict[str, str] | None = None, ms_norm: bool = False, *,
          chunked_loss: bool = False, discovery=None):
    """(the roofline of one step with the assignment, :func:`~approxbp.planner.plan_moves.time_step`; the model's block
    count). A model of more than 3 alike blocks is timed at 3: its block 1 stands for each block, and what is outside
    the blocks does not depend on their number. ``discovery``: the request's
    :class:`~approxbp.kernels.rewrite.discovery.Discovery`, shared by its timings (what patch_model finds, found
    once)."""
    setup, batch, seq = request.setup, request.batch, request.seq
    build = model_spec(request.model, setup.task)
    count = layer_count(build.config) if hasattr(build, "config") else None
    small = count is not None and count[1] > SMALL[-1]
    if small:
        build = hf_builder(shrunk(build.config, count[0], SMALL[-1]), build.task)
    with _fake_like_real(), seeded(0):
        with weights_for(setup), no_init():
            model, make_inputs = build()
            model = prepare(model, setup, request.lora_r)
        first = first_block(model)
        if assignment and small and first:
            assignment = small_assignment(assignment, first.rpartition(".")[0] + ".", SMALL[-1])
        if assignment or ms_norm or chunked_loss:
            apply(model, assignment or {}, ms_norm, make_inputs(batch, seq), chunked_loss=chunked_loss,
                  discovery=discovery)
        blocks = len(block_paths(model, first))
        return time_step(model, make_inputs(batch, seq), setup, device), count[1] if small else blocks


def move_costs(run, request: Request, choice: dict[str, str], ms_norm: bool, after: StepMemory, device, say,
               discovery=None):
    """(the step's roofline with the assignment, its block count, the chunked loss's cost or None, the blocks' parts
    recomputable alone with their measured saving per block): what :func:`plan_moves` weighs at any budget.
    ``discovery``: shared by the request's timings (:func:`timed`)."""
    say(f"recompute and offload moves, timed for {device.name}")
    time, blocks = timed(request, device, choice, ms_norm, discovery=discovery)
    loss = None
    if not request.chunked_loss:
        say("chunked loss: not a move here (the trainer computes the loss from the logits)")
    else:
        loss = _loss_cost(lambda: run(choice, ms_norm, chunked_loss=True),
                          lambda: timed(request, device, choice, ms_norm, chunked_loss=True, discovery=discovery)[0],
                          after, time, blocks, _loss_sizes(request), say)
    parts = {}
    for name in _large_parts(after):
        say(f"recompute {name} alone")
        saving = (after.peak - run(choice, ms_norm, parts=(name,)).peak) // blocks
        if saving > 0:
            parts[name] = saving
    return time, blocks, loss, parts


def _large_parts(step: StepMemory, share: float = 0.1) -> list[str]:
    """The direct children of the first block that save at least ``share`` of its bytes (its attention, its MLP)."""
    if not step.block:
        return []
    mine: dict[str, int] = {}
    for path, b in step.saved.items():
        if path.startswith(step.block + "."):
            name = path[len(step.block) + 1:].split(".")[0]
            mine[name] = mine.get(name, 0) + b
    total = sum(mine.values())
    return [name for name, b in mine.items() if total and b >= share * total]


def _loss_cost(measure, time, after: StepMemory, before, blocks: int, sizes: tuple[int, int, int, int] | None, say):
    """The chunked loss as a move (:class:`~.moves.LossCost`): ``measure()`` and ``time()`` the step with it
    (its saving against ``after``, its modelled seconds against ``before``); its transient one chunk's logits with
    their fp32 softmax and gradient, from ``sizes`` (rows, width, vocabulary, bytes per element). None where the
    model's loss cannot be chunked (said)."""
    if sizes is None:
        say("chunked loss: not a move here (not a Hugging Face model with a vocabulary)")
        return None
    say("the chunked loss")
    try:
        saving = after.peak - measure().peak
    except NotChunked as why:
        say(f"{why}: not a move here")
        return None
    rows, width, vocab, itemsize = sizes
    transient = chunk_rows(rows, width, vocab) * vocab * (2 * itemsize + 8)
    return LossCost(saving, transient, modelled_time(time(), blocks) - modelled_time(before, blocks))


def _loss_sizes(request: Request) -> tuple[int, int, int, int] | None:
    build = model_spec(request.model, request.setup.task)
    config = build.config.get_text_config() if hasattr(build, "config") else None
    if not all(hasattr(config, key) for key in ("hidden_size", "vocab_size")):
        return None
    return request.batch * request.seq, config.hidden_size, config.vocab_size, request.setup.dtype.itemsize
