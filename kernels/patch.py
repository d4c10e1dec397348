"""patch_model: swap activations for their memory-saving versions and merge norms into their consumers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .invact import InvActGELU, InvActSiLU
from .norms import merge_norm
from .relu_sum import ReGELU2, ReSiLU2

_GELU_NAMES = {"GELU", "GELUActivation"}  # torch and Hugging Face transformers
_SILU_NAMES = {"SiLU", "SiLUActivation"}
ACTIVATIONS = ("relu-sum", "invact", None)


@dataclass
class PatchReport:
    activations: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"swapped {len(self.activations)} activations, merged {len(self.norms)} norms"
                + (f"; skipped: {'; '.join(self.skipped)}" if self.skipped else ""))


def _replacement(module: nn.Module, activation: str):
    name = type(module).__name__
    if name in _GELU_NAMES and getattr(module, "approximate", "none") == "none":
        return ReGELU2() if activation == "relu-sum" else InvActGELU()
    if name in _SILU_NAMES:
        return ReSiLU2() if activation == "relu-sum" else InvActSiLU()
    return None


def patch_model(model: nn.Module, activation: str | None = "relu-sum", norm: bool = True,
                example_input: torch.Tensor | None = None) -> PatchReport:
    """In place: replace nn.GELU/nn.SiLU (and HF GELUActivation/SiLUActivation) by ReGELU2/ReSiLU2
    (``activation='relu-sum'``) or InvActGELU/InvActSiLU (``'invact'``); with ``norm=True`` merge every
    LayerNorm/RMSNorm whose outputs feed only Linear layers into them (eq. 58) and replace it by its
    MS-norm. Consumers are found with torch.fx; a norm that cannot be traced or feeds anything else is
    left alone and listed in the report's ``skipped``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    report = PatchReport()
    if norm:
        _merge_norms(model, report)
    if activation:
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                new = _replacement(child, activation)
                if new is not None:
                    setattr(parent, child_name, new)
                    report.activations.append(f"{parent_name + '.' if parent_name else ''}{child_name}: "
                                              f"{type(child).__name__} → {type(new).__name__}")
    return report


def _shape_query(node) -> bool:
    """x.shape / x.size() / x.dim() read no values: they do not stop the memory sharing."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("shape", "dtype", "device")
    return node.op == "call_method" and node.target in ("size", "dim")


def _merge_norms(model: nn.Module, report: PatchReport) -> None:
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as err:  # noqa: BLE001 - any tracing failure means: leave the norms alone, say why
        report.skipped.append(f"norm merging: model is not fx-traceable ({type(err).__name__}: {err})")
        return
    modules = dict(model.named_modules())
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], nn.LayerNorm | nn.RMSNorm):
            continue
        users = [u for u in node.users if not _shape_query(u)]
        consumers = [modules[u.target] for u in users
                     if u.op == "call_module" and isinstance(modules[u.target], nn.Linear)]
        if not users or len(consumers) != len(users):
            report.skipped.append(f"{node.target}: output feeds something other than Linear layers")
            continue
        ms = merge_norm(modules[node.target], consumers)
        parent_name, _, child = node.target.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, ms)
        report.norms.append(f"{node.target} → {type(ms).__name__} merged into "
                            f"{[u.target for u in users]}")
