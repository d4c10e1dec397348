"""approxbp inside Hugging Face ``Trainer`` and TRL's trainers: one callback.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ApproxBPCallback(family="invact", moves={"(loss)": "chunked-loss"})])

Why a callback: it is the one object ``Trainer`` and every TRL trainer (SFT, DPO, GRPO, KTO, GKD: subclasses of
``Trainer``) accept unchanged, and ``on_train_begin`` hands it the model the trainer trains — after peft, whichever
way accelerate wraps it — with the optimizer already holding its Parameters (every rewrite keeps them: the same
objects). The patch itself waits for the first real batch (a forward pre-hook that removes itself): its
arguments, by name, are ``patch_model``'s ``example_input``, so the rewrites are proven and measured on the
shapes the run trains on, outside autocast (the proof compares with stock in the model's own dtype). Then the plan's
moves (``approxbp.planner.moves.apply_moves``: ``"recompute"`` per block path, ``"chunked-loss"`` for ``"(loss)"``)
are applied to the transformers model. The report (saved bytes, every skip with its reason) is logged once and kept
as ``callback.report``.

Checkpoints: a patched model's state dict is the stock model's (the rewrites keep every Parameter under its stock
name and merge nothing), so ``save_model``, ``save_steps`` checkpoints and ``push_to_hub`` load into the stock class
with the trained values (tested).
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from transformers import TrainerCallback

__all__ = ["ApproxBPCallback"]

_logger = logging.getLogger("approxbp")


class ApproxBPCallback(TrainerCallback):
    """Patch the trained model on its first batch: ``patch_model(model, example_input=<that batch>, **patch)``,
    then ``apply_moves(<the transformers model>, moves)``. ``patch``: ``patch_model``'s keyword arguments
    (``family``, ``tables``, ``norms``, ``glu``, ``bits``, ``module_filter_fn``); ``moves``: block path → move, as
    ``approxbp plan --out`` writes them."""

    def __init__(self, *, moves: dict[str, str] | None = None, **patch):
        from approxbp.kernels.rewrite.patch import patch_model

        unknown = sorted(set(patch) - set(patch_model.__kwdefaults__) - {"config"})
        if unknown or "example_input" in patch:
            raise TypeError(f"ApproxBPCallback: {', '.join(unknown) or 'example_input'} is not an argument of "
                            "patch_model it passes on (the example input is the trainer's first batch)")
        self.patch, self.moves, self.report, self._hook = patch, dict(moves or {}), None, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("ApproxBPCallback: the trainer handed no model to on_train_begin")
        if self.report is None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._patch_on_first_batch, with_kwargs=True)

    def _patch_on_first_batch(self, model: nn.Module, args: tuple, kwargs: dict):
        from approxbp.kernels.rewrite.patch import patch_model
        from approxbp.planner.moves import apply_moves

        self._hook.remove()
        self._hook = None
        example = _keywords(model, args, kwargs)
        device = next(model.parameters()).device.type
        with torch.autocast(device, enabled=False):
            self.report = patch_model(model, example_input=example, **self.patch)
        if self.moves:
            target = model.get_base_model() if hasattr(model, "get_base_model") else model
            apply_moves(target, self.moves)
        _logger.info("approxbp: %s", self.report)


def _keywords(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (positional ones bound to the forward's signature), labels included (TRL's
    fused-head forward needs them): the example input is the model's own first call."""
    signature = inspect.signature(model.forward)
    bound = signature.bind_partial(*args, **kwargs).arguments
    out = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif signature.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out
