"""What :func:`~.patch.patch_model` finds by running a model (its norms' readers, its gated MLPs), found once per kind
of model: the planner builds the same model afresh for every step it measures, and each finding costs a forward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..ops.torch_private import pytree

__all__ = ["Discovery", "run_once"]


class Discovery:
    """``find(model, example_input)``'s answer kept per finder, module tree (paths and classes) and the example's
    tensor shapes and dtypes; each caller gets its own deep copy. Hold one per planned request (its set-up, LoRA and
    checkpointing are fixed), never across requests: what a tree and shapes do not show (a set-up's dtype) is not in
    the key."""

    def __init__(self):
        self._found: dict = {}

    def __call__(self, find: Callable, model: nn.Module, example_input):
        inputs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                  for t in pytree.tree_leaves(example_input)]
        tree = tuple((name, type(m).__qualname__) for name, m in model.named_modules())
        key = (find.__module__, find.__qualname__, tree, repr(inputs))
        if key not in self._found:
            self._found[key] = find(model, example_input)
        return copy.deepcopy(self._found[key])


def run_once(find: Callable, model: nn.Module, example_input, discovery: Discovery | None):
    """``find(model, example_input)``, through ``discovery`` when there is one."""
    return find(model, example_input) if discovery is None else discovery(find, model, example_input)
