"""PyTorch's ``MemTracker`` with its per-operation peak update made proportional to the modules running, not to
every module seen: stock ``_update_peak_stats`` walks all tracked modules after each operation to find the active
ones, so tracing a model of L blocks costs O(L²) (a 32-block LLaMA-7B step: most of a two-minute trace). Here the
active modules are looked up by name in ``_mod_tracker.parents``; the peaks recorded are the same numbers
(``tests/approxbp/planner/test_tracker.py`` compares the two trackers module by module)."""

from __future__ import annotations

from copy import deepcopy

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState

__all__ = ["Tracker"]


class Tracker(MemTracker):
    """MemTracker whose peak update visits the running modules only (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self._by_name: dict[str, list] = {}
        self._indexed = -1  # how many tracked modules the index holds (modules are only ever added during a step)

    def _running(self):
        if self._indexed != len(self.memory_tracking):
            self._by_name = {}
            for stats in self.memory_tracking.values():
                self._by_name.setdefault(stats.mod_fqn, []).append(stats)
            self._indexed = len(self.memory_tracking)
        for name in self._mod_tracker.parents:
            yield from self._by_name.get(name, ())

    def _update_peak_stats(self, peak_state) -> None:
        snap = self._curr_mem_snap
        for stats in self._running():
            if peak_state in stats.snapshots:
                for dev, dev_snap in snap.items():
                    if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)

    def innermost_at(self, total: int) -> str | None:
        """"forward of PATH" or "backward of PATH": the innermost module whose local peak is ``total`` (the step's
        peak), or None when no module's is."""
        moment = None
        for stats in self.memory_tracking.values():
            for state, phase in ((_ModState.PEAK_FW, "forward"), (_ModState.PEAK_BW, "backward")):
                if any(next(iter(snap.values()))["Total"] == total for snap in stats.snapshots.get(state, ())):
                    if moment is None or len(stats.mod_fqn) >= len(moment.partition(" of ")[2]):
                        moment = f"{phase} of {stats.mod_fqn}"
        return moment
