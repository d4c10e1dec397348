"""What a patched module stands in for, kept in its ``__dict__`` (not a submodule: no state-dict keys, no
parameters counted twice), so that ``unpatch`` and a second ``patch_model`` call can find it. The one home of
these records for ``patch.py`` and ``norms.py``."""

from __future__ import annotations

from torch import nn

__all__ = ["EXPERT_GATE", "expert_gate", "kept_affine", "mark_expert_gate", "mark_kept_affine", "mark_merged",
           "mark_replaced", "merged", "merged_dtype", "remove_expert_gate", "replaced"]


_REPLACED, _MERGED, _KEPT_AFFINE, _MERGED_DTYPE = "replaced", "merged_from", "kept_affine", "merged_dtype"


def mark_replaced(new: nn.Module, old: nn.Module) -> None:
    """``new`` took ``old``'s place (a drop-in, a wrapped consumer): unpatching puts ``old`` back."""
    new.__dict__[_REPLACED] = old


def replaced(module: nn.Module) -> nn.Module | None:
    return module.__dict__.get(_REPLACED)


def mark_merged(ms: nn.Module, norm: nn.Module, consumers: list, created: list) -> None:
    """``ms`` is ``norm`` with its affine folded into ``consumers`` (``created``: biases made for it); the
    consumers' dtype then is kept too (a cast of the model since, ``.half()``, is applied to ``norm`` on unmerging)."""
    ms.__dict__[_MERGED] = (norm, consumers, created)
    ms.__dict__[_MERGED_DTYPE] = consumers[0].weight.dtype


def merged_dtype(ms: nn.Module):
    """The consumers' weight dtype when ``ms`` was merged."""
    return ms.__dict__.get(_MERGED_DTYPE)


def merged(module: nn.Module) -> tuple | None:
    """(norm, consumers, created) of a merged MS-norm, or None."""
    return module.__dict__.get(_MERGED)


def mark_kept_affine(ms: nn.Module) -> None:
    """``ms`` keeps its norm's affine in wrapped consumers (LoRA: frozen weights cannot absorb it)."""
    ms.__dict__[_KEPT_AFFINE] = True


def kept_affine(module: nn.Module) -> bool:
    return module.__dict__.get(_KEPT_AFFINE, False)


#: The instance attribute an experts module's exact gate is installed as (the class keeps its own ``_apply_gate``).
EXPERT_GATE = "_apply_gate"
_GATED = "expert_gate_installed"
_OWN_FORWARD = "expert_forward_installed"


def mark_expert_gate(experts: nn.Module, gate, forward=None) -> None:
    """``experts`` computes act(g)·u with ``gate`` (:mod:`.moe_patch`): its act_fn is no longer called; with
    ``forward``, that replaces its forward too (the down projection's input recomputed)."""
    experts.__dict__[EXPERT_GATE] = gate
    experts.__dict__[_GATED] = True
    if forward is not None:
        experts.__dict__["forward"] = forward
        experts.__dict__[_OWN_FORWARD] = True


def expert_gate(experts: nn.Module):
    """The gate :func:`mark_expert_gate` installed on ``experts``, or None."""
    return experts.__dict__.get(EXPERT_GATE) if experts.__dict__.get(_GATED) else None


def remove_expert_gate(experts: nn.Module) -> None:
    """Unpatch: the class's own ``_apply_gate`` again."""
    if experts.__dict__.pop(_GATED, False):
        experts.__dict__.pop(EXPERT_GATE, None)
        if experts.__dict__.pop(_OWN_FORWARD, False):
            experts.__dict__.pop("forward", None)
