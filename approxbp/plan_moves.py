"""``approxbp plan --budget … --gpu …`` beyond the approximations (issue 46): when the least-error assignment cannot
reach the budget, the most-saving one is taken (the approximations cost no modelled time: their kernels move fewer
bytes than the exact ones) and blocks are recomputed or offloaded (:mod:`approxbp.moves`) at the least modelled step
time (:mod:`approxbp.step_time`, a roofline for the named GPU on fake tensors). The peak is modelled from the
measured step: its end-of-forward bytes less each move's saving, plus the largest moved block's bytes (the one
block a recompute rebuilds, or an offload brings back, at a time)."""

from __future__ import annotations

from approxbp.chunked_loss import CHUNKED, LOSS
from approxbp.gpus import GPU
from approxbp.moves import BlockCost, LossCost, choose_moves
from approxbp.step_memory import StepMemory, first_block
from approxbp.step_time import Roofline, StepTime, block_paths


def time_step(model, inputs: dict, setup, device: GPU) -> StepTime:
    """The roofline of one training step of ``model`` (forward under the set-up's autocast, then backward), charged
    to its blocks; on fake tensors inside the caller's fake mode."""
    from approxbp.step_memory import _autocast, _loss_of

    clock = Roofline(device, type(model).__name__, block_paths(model, first_block(model)))
    with clock, _autocast(setup):
        loss = _loss_of(model(**inputs))
    with clock:
        loss.backward()
    return clock.time


def block_costs(step: StepMemory, time: StepTime, bytes_per_element: int) -> dict[str, BlockCost]:
    """Each block's measured bytes and modelled seconds: S_b from the step's bytes charged to its modules, I_b its
    input hidden state, F_b and B_b the roofline's (a block the timing model did not have takes block 1's)."""
    prefix = step.block.rpartition(".")[0] + "." if step.block else ""
    if not prefix:
        return {}
    saved: dict[str, int] = {}
    for path, b in step.saved.items():
        if path.startswith(prefix):
            index = path[len(prefix):].split(".")[0]
            saved[prefix + index] = saved.get(prefix + index, 0) + b
    stand_in = prefix + "1"
    return {path: BlockCost(s, step.block_input * bytes_per_element,
                            time.forward.get(path, time.forward.get(stand_in, 0.0)),
                            time.backward.get(path, time.backward.get(stand_in, 0.0)))
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
               bytes_per_element: int, loss: LossCost | None = None) -> dict:
    """The moves of least modelled time that bring the step's peak to ``budget`` (see the module docstring): the
    moves, the modelled peak and its parts, the modelled seconds before and after. ``loss``: the chunked loss's
    measured cost, an item beside the blocks (None: the model's loss cannot be chunked)."""
    costs: dict = block_costs(step, time, bytes_per_element)
    if loss is not None:
        costs[LOSS] = loss
    moves = choose_moves(costs, step.peak - budget, device.host_link)
    taken = sum(costs[p].saving(m) for p, m in moves.items())
    transient = max((costs[p].saved for p in moves), default=0)
    base = modelled_time(time, blocks)
    extra = sum(costs[p].seconds(m, device.host_link) for p, m in moves.items())
    return {"moves": moves, "gpu": device.name, "gpu_source": device.source,
            "end_of_forward": step.peak - taken, "transient": transient, "peak": step.peak - taken + transient,
            "seconds_before": base, "seconds_after": base + extra,
            "by_move": {m: sum(1 for v in moves.values() if v == m) for m in ("recompute", "offload", CHUNKED)},
            "chunked_loss": None if loss is None else {"saving": loss.takes, "transient": loss.saved,
                                                       "seconds": loss.extra}}
