"""What a patched module stands in for, kept in its ``__dict__`` (not a submodule: no state-dict keys, no
parameters counted twice), so that ``unpatch`` and a second ``patch_model`` call can find it. The one home of
these records, and of every key approxbp keeps in a module's ``__dict__`` (:data:`KEYS`, each prefixed
``_approxbp_``; the other modules name them from here): a debugger's ``vars(module)`` shows them by that prefix."""

from __future__ import annotations

from torch import nn

__all__ = ["CALL_SITE", "CHUNKED_LOSS", "EXPERT_GATE", "expert_gate", "kept_affine", "KEYS", "mark_expert_gate",
           "mark_kept_affine", "mark_merged", "mark_replaced", "merged", "merged_dtype", "MOVE", "NO_CACHE",
           "NORM_FORM", "REFUSES_STOCK_LAYOUT", "remove_expert_gate", "replaced", "Z_HANDOFF"]


_REPLACED, _MERGED, _KEPT_AFFINE, _MERGED_DTYPE = ("_approxbp_replaced", "_approxbp_merged_from",
                                                   "_approxbp_kept_affine", "_approxbp_merged_dtype")
#: A module's proven norm form, cached (``norm_forms.norm_form``).
NORM_FORM = "_approxbp_norm_form"
#: The call-site drop-ins of a module whose forward calls an activation function (``functional_swap``).
CALL_SITE = "_approxbp_call_site"
#: A model whose stock layout a rewrite refused once (said once, ``norm_merge``).
REFUSES_STOCK_LAYOUT = "_approxbp_refuses_stock_layout"
#: A block's memory move: (move, the BoundForward installed) (``approxbp.planner.moves``).
MOVE = "_approxbp_move"
#: The forward that turns the KV cache off while training (``approxbp.planner.moves``).
NO_CACHE = "_approxbp_no_cache_while_training"
#: The chunked loss's forward (``approxbp.planner.chunked_loss``).
CHUNKED_LOSS = "_approxbp_chunked_loss"
#: A shared-output MS-norm's hand-off of z to its consumers (``norm_merge.ZHandoff``).
Z_HANDOFF = "_approxbp_z_handoff"


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
_GATED = "_approxbp_expert_gate_installed"
_OWN_FORWARD = "_approxbp_expert_forward_installed"
#: Every key approxbp keeps in a module's ``__dict__`` (``_apply_gate`` is the name the experts class calls).
KEYS = (_REPLACED, _MERGED, _KEPT_AFFINE, _MERGED_DTYPE, NORM_FORM, CALL_SITE, REFUSES_STOCK_LAYOUT, MOVE, NO_CACHE,
        CHUNKED_LOSS, Z_HANDOFF, EXPERT_GATE, _GATED, _OWN_FORWARD)


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
