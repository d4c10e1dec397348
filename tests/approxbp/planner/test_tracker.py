"""The planner's Tracker records what PyTorch's MemTracker records — the step's peak snapshot and every module's
forward and backward peaks — on a step with activation checkpointing (modules re-entered in the backward)."""

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from approxbp.planner.tracker import Tracker


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Net(nn.Module):
    def __init__(self, d=16, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i % 2 else b(x)
        return x.square().mean()


def _record(tracker_type):
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 32, 16)
    opt = torch.optim.AdamW(model.parameters())
    tracker = tracker_type()
    tracker.track_external(model, opt)
    with tracker:
        model(x).backward()
        opt.step()
    modules = {stats.mod_fqn: {str(state): [next(iter(s.values())) for s in snaps]
                               for state, snaps in stats.snapshots.items()}
               for stats in tracker.memory_tracking.values()}
    return tracker.get_tracker_snapshot("peak"), modules


def test_the_tracker_records_what_memtracker_records():
    peak, modules = _record(Tracker)
    stock_peak, stock_modules = _record(MemTracker)
    assert peak == stock_peak
    assert modules == stock_modules
    assert len(modules) == 1 + 4 + 8  # the net, its blocks and their Linears: each module's peaks compared
