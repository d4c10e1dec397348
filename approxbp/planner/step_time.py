"""A training step's time, modelled for a named GPU on the planner's fake tensors: a roofline per aten op,

    t_op = max(FLOPs / P, bytes / B),

FLOPs from PyTorch's own counters (``torch.utils.flop_counter.flop_registry``: matmuls, convolutions, attention),
bytes the op's inputs and outputs (each storage once), P the GPU's dense peak for the op's dtype and B its memory
bandwidth; charged to the innermost repeated block running it (``ModTracker``: forward and backward). PyTorch's
``RuntimeEstimator`` computes the same roofline but reads P and B from a CUDA device (it asserts one is present);
a plan names a GPU it does not run on, so the constants below stand in, with their sources. It is a lower bound (no
launch or host time: the eager patched ViT on an H100 was host-bound at 2.4×, docs/training.md) and the docs call
every time from it a model.

Our drop-ins (modules of ``approxbp.kernels``: MS-norms, activation tables, fused GLUs, the norms' consumers) run as
their CPU twins on fake tensors, several elementwise ops where the GPU runs one kernel; charged op by op they would
cost each intermediate's round trip to memory. They are charged as the kernel they are instead: one region per
call of the outermost drop-in (forward, and its backward): its elementwise ops together cost (bytes read from
outside the region + bytes the region leaves alive) / B — the inputs read once, the outputs and saved tensors
written once, the temporaries freed inside it never touching memory (``approxbp cost``: the kernels run at that
byte budget); a matmul inside a drop-in is charged as itself, a library call as in the stock model, and what it
reads from the region counts as written. ``fused=True`` charges a compiled graph alike: its elementwise ops between
library calls as Inductor's fused kernels (the graph frees each value after its last use, so the survivors are
what it saves and returns).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from approxbp.kernels.ops.torch_private import TorchDispatchMode, pytree, storage_key
from approxbp.planner.gpus import GPU

__all__ = ["block_paths", "drop_in_paths", "Roofline", "StepTime"]


@dataclass
class StepTime:
    """Modelled seconds of one training step, in total and per block (forward, backward)."""

    forward: dict[str, float] = field(default_factory=dict)  # block path ("" outside blocks) → seconds
    backward: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)  # a part of a block ("model.layers.1.mlp") → forward s

    @property
    def total(self) -> float:
        return sum(self.forward.values()) + sum(self.backward.values())


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _innermost(parents, among) -> str | None:
    """The longest path of ``among`` in ``parents`` (ModTracker's set of running modules), ties by name; None."""
    return max((p for p in parents if p in among), key=lambda p: (len(p), p), default=None)


def _outermost(parents, among) -> str | None:
    """The shortest path of ``among`` in ``parents``, ties by name; None. In a backward ModTracker may hold
    siblings at once (k_proj and v_proj): a tie broken by the set's order made the step's seconds depend on
    PYTHONHASHSEED."""
    return min((p for p in parents if p in among), key=lambda p: (len(p), p), default=None)


class Roofline(TorchDispatchMode):
    """Charges each op's roofline time to the innermost of ``blocks`` (module paths of the model whose class is
    ``root``; "" for none) running it."""

    def __init__(self, device: GPU, root: str, blocks: list[str], drop_ins: list[str] = (), fused: bool = False,
                 parts: list[str] = ()):
        super().__init__()
        from torch.distributed._tools.mod_tracker import ModTracker

        # ModTracker names a module by its path under the root module's class name
        self.device, self.tracker = device, ModTracker()
        self.blocks = {f"{root}.{b}": b for b in blocks}
        self.drop_ins = {f"{root}.{d}" for d in drop_ins}
        self.parts = {f"{root}.{p}": p for p in parts}  # their forward time is also kept apart (module recompute)
        self.fused = fused  # every elementwise op in one region per phase: a compiled graph, as Inductor fuses it
        self.region: _Region | None = None
        self.time = StepTime()

    def __enter__(self):
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._close()
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def _charge(self, seconds: float, where: str, backward: bool, part: str | None = None) -> None:
        phase = self.time.backward if backward else self.time.forward
        phase[where] = phase.get(where, 0.0) + seconds
        if part is not None and not backward:
            self.time.parts[part] = self.time.parts.get(part, 0.0) + seconds

    def _close(self) -> None:
        if self.region is not None:
            r, self.region = self.region, None
            self._charge(r.moved() / self.device.memory_bandwidth, r.where, r.backward, r.part)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        ins, _ = pytree.tree_flatten((args, kwargs))
        outs, _ = pytree.tree_flatten(out)
        flops = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        dtype = next((t.dtype for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.float32)
        parents = self.tracker.parents
        inside = _innermost(parents, self.blocks)
        where = self.blocks[inside] if inside else ""
        part = self.parts[p] if (p := _outermost(parents, self.parts)) else None
        drop_in = "(fused)" if self.fused else _outermost(parents, self.drop_ins)
        key = (drop_in, self.tracker.is_bw)
        if self.region is not None and self.region.key != key:
            self._close()
        # a view (t, view, detach, …) or a query (prim.device) moves no bytes
        nothing = func.is_view or not any(isinstance(t, torch.Tensor) for t in outs)
        if drop_in is not None and not flops and not nothing:  # a matmul inside a drop-in is a library call of its own
            if self.region is None:
                self.region = _Region(key, where, self.tracker.is_bw, part)
            self.region.add(ins, outs)
            return out
        if self.region is not None:  # what a library call reads from the region was written to memory
            self.region.escape(ins)
        moved = 0 if nothing else _bytes(ins + outs)
        self._charge(max(flops / self.device.peak(dtype), moved / self.device.memory_bandwidth), where,
                     self.tracker.is_bw, part)
        return out


class _Region:
    """The elementwise ops of one call of a drop-in (forward or backward), charged as one kernel: bytes read from
    storages made outside it (once each), and written to storages made inside it that are still alive when it
    ends or that a library call inside it (a matmul) read."""

    def __init__(self, key, where: str, backward: bool, part: str | None = None):
        self.key, self.where, self.backward, self.part = key, where, backward, part
        self.read, self.seen, self.made, self.escaped = 0, set(), {}, set()
        self.held = []  # every storage seen, alive while the region is open: no freed one lends its address

    def add(self, ins, outs) -> None:
        for t in ins:
            if not isinstance(t, torch.Tensor):
                continue
            if (k := storage_key(t)) not in self.seen and k not in self.made:
                self.seen.add(k)
                self.held.append(t.untyped_storage())
                self.read += t.untyped_storage().nbytes()
        for t in outs:  # a view or an in-place result of what it read is not a new storage
            if isinstance(t, torch.Tensor) and storage_key(t) not in self.seen:
                storage = t.untyped_storage()
                if storage_key(t) not in self.made:
                    self.held.append(storage)  # the storage, not the tensor: "alive at the end" is the tensor's
                self.made.setdefault(storage_key(t), []).append((weakref.ref(t), storage.nbytes()))

    def escape(self, ins) -> None:
        for t in ins:
            if isinstance(t, torch.Tensor) and (k := storage_key(t)) in self.made:
                self.escaped.add(k)

    def moved(self) -> int:
        written = [refs for k, refs in self.made.items() if k in self.escaped or any(r() is not None for r, _ in refs)]
        return self.read + sum(refs[0][1] for refs in written)


def drop_in_paths(model: torch.nn.Module) -> list[str]:
    """The paths of the model's modules that are our drop-ins (classes of ``approxbp.kernels``, and every registered
    family's drop-in activation)."""
    from approxbp.kernels.ops.modules import drop_in_classes

    ours = drop_in_classes()
    return [n for n, m in model.named_modules()
            if n and (type(m).__module__.startswith("approxbp.kernels") or isinstance(m, ours))]


def block_paths(model: torch.nn.Module, first: str) -> list[str]:
    """Every block of the ModuleList whose entry 0 is ``first`` (the planner's first_block); [] for none."""
    if not first:
        return []
    parent = first.rpartition(".")[0]
    return [f"{parent}.{i}" for i in range(len(dict(model.named_modules())[parent]))]
