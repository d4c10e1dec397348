"""Memory moves per block beyond the approximations: keep, recompute, offload — planned from one
measured step, timed by the roofline model (:mod:`approxbp.planner.step_time`), applied to a real model.

For a block b with saved bytes S_b (the step's bytes charged to b's modules), input bytes I_b (its tensor arguments),
forward time F_b and backward time B_b (the roofline, seconds), on a GPU with host link L (bytes/s):

* **recompute** — the block runs under ``torch.utils.checkpoint`` (non-reentrant): only its inputs stay (I_b instead
  of S_b); the backward reruns its forward (+F_b) and rebuilds S_b for that block alone, a transient.
* **offload** — ``saved_tensors_hooks`` around its forward copy each tensor it saves to host memory and back when
  the backward reads it: nothing stays on the device (−S_b); the copies take 2·S_b/L, hidden behind the block's
  own compute where shorter: +max(0, 2·S_b/L − F_b − B_b). Coming back, one block's S_b is on the device again.
* **recompute a part** — one direct child of the block (its attention or its MLP) under the checkpoint alone
  (selective checkpointing at module grain): it takes off what a step with that part of every block recomputed
  measures less, per block, and adds the part's forward time F_c (the roofline's, charged to the part).
* **chunked loss** — one item beside the blocks (:mod:`~.chunked_loss`): a causal LM's loss a chunk of rows
  at a time; it takes the measured bytes the logits' loss kept (a step measured with it) and adds the modelled
  seconds of that step's head recomputation; one chunk's logits are its transient.

The planned end-of-forward bytes are the measured step's with S_b replaced as above (exact: the tests count them
on real tensors); the peak adds the largest S_b of a moved block, the transient of either move.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from approxbp.kernels.ops.torch_private import FakeTensor, storage_key
from approxbp.kernels.rewrite import swaps
from approxbp.kernels.rewrite.bound_forward import install_forward, uninstall_forward
from approxbp.planner.chunked_loss import CHUNKED, apply_chunked_loss, remove_chunked_loss
from approxbp.planner.knapsack import multiple_choice

__all__ = ["apply_moves", "block_moves", "BlockCost", "choose_moves", "host_elsewhere", "LossCost", "Offload",
           "RECOMPUTE_PART", "remove_moves"]


_MOVES = ("keep", "recompute", "offload")
#: A block's move that recomputes one of its parts alone: "recompute mlp" (selective checkpointing, module grain).
RECOMPUTE_PART = "recompute "
_MOVED = swaps.MOVE  # the block's __dict__: (move, the BoundForward installed)


@dataclass(frozen=True)
class BlockCost:
    """One block's measured bytes and modelled seconds."""

    saved: int  # S_b
    inputs: int  # I_b
    forward: float  # F_b
    backward: float  # B_b
    parts: tuple = ()  # (name, measured saving, forward seconds) of each part recomputable alone ("mlp")

    @property
    def moves(self) -> tuple[str, ...]:
        return _MOVES + tuple(f"{RECOMPUTE_PART}{name}" for name, _, _ in self.parts)

    def saving(self, move: str) -> int:
        """Bytes the move takes off the end of the forward."""
        if move.startswith(RECOMPUTE_PART):
            return next(s for name, s, _ in self.parts if RECOMPUTE_PART + name == move)
        return {"keep": 0, "recompute": self.saved - self.inputs, "offload": self.saved}[move]

    def seconds(self, move: str, host_link: float) -> float:
        """Modelled seconds the move adds to the step."""
        if move.startswith(RECOMPUTE_PART):
            return next(t for name, _, t in self.parts if RECOMPUTE_PART + name == move)
        if move == "recompute":
            return self.forward
        if move == "offload":
            return max(0.0, 2 * self.saved / host_link - self.forward - self.backward)
        return 0.0


@dataclass(frozen=True)
class LossCost:
    """The chunked loss's measured saving, its transient (one chunk's logits, as ``saved``: the bytes it brings
    back) and its modelled seconds."""

    takes: int
    saved: int
    extra: float
    moves = ("keep", CHUNKED)

    def saving(self, move: str) -> int:
        return self.takes if move == CHUNKED else 0

    def seconds(self, move: str, host_link: float) -> float:
        return self.extra if move == CHUNKED else 0.0


class Offload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to host memory (pinned, asynchronous copies) and back on use; ``moved`` counts their bytes once
    per storage. A CPU tensor stays where it is (it is host memory already) but is counted."""

    def __init__(self):
        self.moved, self._seen = 0, set()
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        key = storage_key(t)
        if key not in self._seen:
            self._seen.add(key)
            self.moved += t.untyped_storage().nbytes()
        if t.device.type == "cpu":
            return t.device, (_Host(t) if _HOST_ELSEWHERE.get() else t)
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        return t.device, host.copy_(t, non_blocking=True)

    @staticmethod
    def _unpack(packed):
        device, t = packed
        return t.back() if isinstance(t, _Host) else t.to(device, non_blocking=True)


#: Set by a traced step (:func:`~.step_memory.traced_step`): the host is another memory than the device's, even on
#: the CPU, so an offloaded tensor leaves what MemTracker counts and comes back anew when the backward reads it.
_HOST_ELSEWHERE = contextvars.ContextVar("approxbp_host_elsewhere", default=False)


@contextlib.contextmanager
def host_elsewhere():
    """Within: an offloaded tensor is held outside torch, as a GPU's offload holds it in host memory."""
    token = _HOST_ELSEWHERE.set(True)
    try:
        yield
    finally:
        _HOST_ELSEWHERE.reset(token)


class _Host:
    """A CPU tensor held outside torch (its bytes in numpy; a fake tensor: its shape only), as a GPU's offload holds
    it in host memory; :meth:`back` allocates it again."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = t.shape, t.dtype
        flat = t.detach().reshape(-1)
        self.data = None if isinstance(t, FakeTensor) else flat.view(torch.uint8).numpy().copy()

    def back(self) -> torch.Tensor:
        if self.data is None:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_numpy(self.data.copy()).view(self.dtype).reshape(self.shape)


def block_moves(moves: dict[str, str]) -> list[tuple[str, str]]:
    """(module path, keep/recompute/offload) of each entry of ``moves`` (``"recompute PART"`` of a block: its part
    recomputed); anything else refused in one line, the chunked loss with the argument that asks for it."""
    found = []
    for path, move in moves.items():
        if move == CHUNKED:
            raise ValueError(f"{path} → {CHUNKED!r}: the chunked loss is not a block's move; pass chunked_loss=True")
        if isinstance(move, str) and move.startswith(RECOMPUTE_PART):
            path, move = f"{path}.{move[len(RECOMPUTE_PART):]}", "recompute"
        if move not in _MOVES:
            raise ValueError(f"block {path}: move {move!r}, expected one of {', '.join(_MOVES)} or "
                             f"'{RECOMPUTE_PART}PART'")
        found.append((path, move))
    return found


def apply_moves(model: nn.Module, moves: dict[str, str], *, chunked_loss: bool = False) -> nn.Module:
    """In place: each block of ``moves`` (module path → move) recomputed or offloaded (``keep`` leaves it), and the
    loss chunked (``chunked_loss``: :func:`~.chunked_loss.apply_chunked_loss`). A recomputed block's inputs are saved
    by the checkpoint through the saved-tensor hooks, so the hooks' count is the device's."""
    modules, resolved = dict(model.named_modules()), []
    for path, move in block_moves(moves):  # every entry checked before the model is changed
        if path not in modules:
            raise ValueError(f"block {path}: no such module in {type(model).__name__}")
        resolved.append((modules[path], move))
    if any(move == "recompute" for _, move in resolved):
        _no_cache_while_training(model)  # first: the chunked loss, if any, wraps it (remove_moves unwraps in turn)
    if chunked_loss:
        apply_chunked_loss(model)
    for block, move in resolved:
        if move == "keep" or _MOVED in block.__dict__:
            continue
        block.__dict__[_MOVED] = (move, install_forward(block, _recompute if move == "recompute" else _offload))
    return model


#: A block's keyword arguments that hold the KV cache it writes (transformers' names across its layers).
_CACHE_ARGS = ("past_key_values", "past_key_value", "cache", "layer_past")
_NO_CACHE = swaps.NO_CACHE  # the model's __dict__: the BoundForward installed


def _recompute(block: nn.Module, inner, *args, **kwargs):
    """The block under a non-reentrant checkpoint. Training with grad, as transformers' GradientCheckpointingLayer
    does: ``use_cache=False`` and no cache handed in, since the replay in the backward would write its keys and values
    into the cache a second time (eager attention: "24 vs 12")."""
    from torch.utils.checkpoint import checkpoint

    if block.training and torch.is_grad_enabled():
        kwargs.update({k: None for k in _CACHE_ARGS if kwargs.get(k) is not None})
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
    return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def _no_cache_while_training(model: nn.Module) -> None:
    """A model with recomputed blocks makes no KV cache in training calls with grad (``use_cache=False``), as a
    transformers model with gradient checkpointing on: the blocks could not fill it (see :func:`_recompute`)."""
    if _NO_CACHE not in model.__dict__ and "use_cache" in inspect.signature(model.forward).parameters:
        model.__dict__[_NO_CACHE] = install_forward(model, _no_cache_forward)


def _no_cache_forward(model: nn.Module, inner, *args, **kwargs):
    if model.training and torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return inner(*args, **kwargs)


def _offload(block: nn.Module, inner, *args, **kwargs):
    with Offload():
        return inner(*args, **kwargs)


def remove_moves(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_moves`: each moved block gets the forward it had, the loss its stock computation."""
    remove_chunked_loss(model)
    uninstall_forward(model, model.__dict__.pop(_NO_CACHE, None))
    for block in model.modules():
        if _MOVED in block.__dict__:
            uninstall_forward(block, block.__dict__.pop(_MOVED)[1])
    return model


def choose_moves(costs: dict[str, BlockCost], need: int, host_link: float,
                 loss: LossCost | None = None) -> tuple[dict[str, str], bool]:
    """(block path → move, whether the loss is chunked): the moves of least modelled time that take at least ``need``
    bytes off the end of the forward plus the transient they bring back (the largest S_b moved); ``loss``: the
    chunked loss, an item of the knapsack beside the blocks. ({}, False) when ``need`` ≤ 0. Exhaustive over which
    item sets the transient (the largest moved S_b), then a multiple-choice knapsack by dynamic programming on the
    bytes."""
    if need <= 0:
        return {}, False
    items: list[tuple[str | None, BlockCost | LossCost]] = [*costs.items(), *([(None, loss)] if loss else [])]
    best: tuple[float, list[tuple[str | None, str]]] | None = None
    for cap in sorted({c.saved for _, c in items}):
        picked = _knapsack([(k, c) for k, c in items if c.saved <= cap], need + cap, host_link)
        if picked is not None and (best is None or picked[0] < best[0]):
            best = picked
    if best is None:
        top = sum(max(c.saving(m) for m in c.moves) for _, c in items)
        raise ValueError(f"no moves fit: {need} bytes over the budget, and recomputing or offloading every block "
                         f"(and the chunked loss, where it applies) takes at most {top} bytes off, less the largest "
                         "transient")
    return {k: m for k, m in best[1] if k is not None}, any(k is None and m == CHUNKED for k, m in best[1])


def _knapsack(items: list[tuple[str | None, BlockCost | LossCost]], need: int,
              host_link: float) -> tuple[float, list[tuple[str | None, str]]] | None:
    """Least total seconds with Σ saving ≥ need (:func:`approxbp.planner.knapsack.multiple_choice`, bytes in units of
    need/2048): (seconds, [(item key, its move) for each item moved])."""
    groups = [[(c.saving(m), c.seconds(m, host_link)) for m in c.moves] for _, c in items]
    found = multiple_choice(groups, need, max(1, need // 2048))
    if found is None:
        return None
    return found[0], [(key, c.moves[j]) for (key, c), j in zip(items, found[1]) if j]
