"""A spawned FSDP2 rank (gloo, CPU) that measures one training step's peak with PyTorch's MemTracker: blocks and
then the model ``fully_shard``-ed as users wrap them, AdamW's states made by a first step, the second step traced;
for each weights dtype in turn, in one process group (one spawn of the ranks for all of them)."""

import gc

import torch
from _patched_gpt import gloo_group


def shard_worker(rank: int, world: int, port: int, model_text: str, weights: tuple[str, ...], batch: int, seq: int,
                 out: str) -> None:
    """Rank ``rank``'s peak for each of ``weights``, saved to ``{out}-{weights}.{rank}``."""
    with gloo_group(rank, world, port):
        for w in weights:
            torch.save(_rank_peak(model_text, w, batch, seq), f"{out}-{w}.{rank}")
            gc.collect()  # the last model and optimizer gone before the next is tracked


def _rank_peak(model_text: str, weights: str, batch: int, seq: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import fully_shard

    from approxbp.planner.models import model_spec
    from approxbp.planner.step_memory import first_block
    from approxbp.planner.training import Setup, weights_for

    torch.manual_seed(0)
    with weights_for(Setup(weights=weights)):
        model, inputs = model_spec(model_text)()
    model.train()
    blocks = first_block(model).rpartition(".")[0]
    for block in dict(model.named_modules())[blocks]:
        fully_shard(block)
    fully_shard(model)
    x = inputs(batch, seq)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        model(**x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
