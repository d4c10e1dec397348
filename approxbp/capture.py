"""The inputs a model feeds its activations, captured as histograms: the weight of a fit to that model
(``approxbp fit relu-sum --weight inputs.json``, :class:`approxbp.fitting.weights.Histogram`).

    with activation_inputs(model) as inputs:
        model(**batch)
    inputs["silu"].save("silu-inputs.json")
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

__all__ = ["activation_inputs"]


@contextlib.contextmanager
def activation_inputs(model: nn.Module, *, bins: int = 256, samples: int = 1_000_000, seed: int = 0):
    """Within: every activation module of ``model`` that ``patch_model`` would swap (``nn.SiLU``, ``nn.GELU``, a
    gated MLP's ``act_fn``, …) records its inputs; yields a dict that holds, after the block, each activation's
    :class:`~approxbp.fitting.weights.Histogram` ({"silu": …}) over ``bins`` equal bins of the inputs' range (at most
    ``samples`` of them, drawn uniformly with ``seed`` where more ran). Activations called as functions
    (``F.silu(x)``) are not modules and are not seen."""
    from approxbp.fitting.weights import Histogram
    from approxbp.kernels.rewrite.activation_swap import ACTIVATION_CLASSES, class_key

    seen: dict[str, list[torch.Tensor]] = {}

    def record(name):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(name, []).append(args[0].detach().reshape(-1).float().cpu())
        return hook

    handles = [m.register_forward_pre_hook(record(ACTIVATION_CLASSES[class_key(m)])) for m in model.modules()
               if class_key(m) in ACTIVATION_CLASSES]
    found: dict = {}
    try:
        yield found
    finally:
        for h in handles:
            h.remove()
    for name, parts in seen.items():
        values = torch.cat(parts).numpy().astype(np.float64)
        values = values[np.isfinite(values)]
        if values.size > samples:
            values = np.random.default_rng(seed).choice(values, samples, replace=False)
        if values.size == 0 or values.min() == values.max():
            continue  # no spread to weight by
        counts, edges = np.histogram(values, bins=bins)
        found[name] = Histogram(tuple(edges.tolist()), tuple(counts.astype(float).tolist()),
                                f"{type(model).__name__} {name} inputs")
