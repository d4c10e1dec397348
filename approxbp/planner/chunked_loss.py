"""The chunked loss, a memory move of ``approxbp plan``: a causal LM's loss computed a chunk of tokens at a
time, so the logits are never materialised.

For hidden states H (r rows of width d after the final norm), the head W (V × d) and the shifted labels y, the loss
is Σ_c CE_sum(W·H_c, y_c) / N, N the count of labels ≠ ignore_index (or the caller's ``num_items_in_batch``) — the
same value as Hugging Face's ``ForCausalLMLoss`` (fp32 logits, mean over counted tokens), summed in another order.
Each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): it saves only its rows of H (a view of the tensor
the head saves anyway) and recomputes its logits in the backward, so the step keeps no r × V tensor: stock keeps
the fp32 log-softmax (4·r·V bytes); the cost is one more head matmul (2·r·d·V FLOPs). A chunk has ⌈r / ⌈V/d⌉⌉ rows,
so its logits are about the size of H (the transient), and at least :data:`_MIN_ROWS`.

The model's forward runs as stock, with its labels, its head returning its input and its ``loss_function``
computing the chunked cross-entropy from what the head was given: the model adds what it adds itself (an MoE's
router_aux_loss_coef · aux_loss), so the loss is the model's own. It applies only when the model hands that tensor
to its loss function and returns it as its logits unchanged (no soft-capping or scaling after the head) — else the
call raises. With the move, a training call with labels returns the loss and no logits (that is the move: nothing
else is returned differently; reading ``outputs.logits`` raises :data:`NO_LOGITS`, which says so and how to turn it
off); without labels, or without grad, the model runs as stock."""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from approxbp.kernels.rewrite import swaps
from approxbp.kernels.rewrite.bound_forward import install_forward, uninstall_forward

__all__ = ["apply_chunked_loss", "chunk_rows", "CHUNKED", "NO_LOGITS", "NotChunked", "refusal",
           "remove_chunked_loss"]


#: A plan's name for the move (counted in its ``by_move``; whether it is chosen: ``moves["chunked_loss"]["chosen"]``).
CHUNKED = "chunked-loss"


_APPLIED = swaps.CHUNKED_LOSS  # the model's __dict__: the BoundForward installed
_LOSS_ARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


#: The fewest rows a chunk has (all of them if fewer): a chunk's matmul reads the whole head W for 2·rows FLOPs per
#: 16-bit weight element, so it is bound by memory below ≈ peak / bandwidth FLOP per byte (H100: 989e12 / 3.35e12 ≈
#: 295 rows; A100 153); with fewer rows, every chunk would read W again for nothing.
_MIN_ROWS = 512


def chunk_rows(rows: int, width: int, vocab: int) -> int:
    """Rows per chunk: ⌈rows / ⌈vocab / width⌉⌉, so one chunk's logits are about the size of the hidden states, but
    at least :data:`_MIN_ROWS` (or every row)."""
    return max(-(-rows // max(1, -(-vocab // max(1, width)))), min(rows, _MIN_ROWS), 1)


class NotChunked(ValueError):
    """The chunked loss cannot apply to this model (the reason is the message)."""


def refusal(model: nn.Module) -> str | None:
    """Why the chunked loss cannot apply to ``model`` (None: it can): a Hugging Face causal LM whose loss is
    ``ForCausalLMLoss``, whose output embeddings are a module, and whose logits reach the loss as the head makes them
    (no encoder-decoder computing its own loss, no soft-capping): refused here, at construction, not at a call."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "needs transformers (a causal LM's ForCausalLMLoss)"
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return f"{type(model).__name__}'s loss is not transformers' ForCausalLMLoss"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        return f"{type(model).__name__} has no output embeddings (its head) to chunk"
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return (f"{type(model).__name__} is an encoder-decoder: its forward computes the loss itself from the "
                "logits (not through loss_function), so no chunk of them can stand in")
    if getattr(config, "final_logit_softcapping", None):
        return (f"{type(model).__name__} soft-caps its logits after the head (final_logit_softcapping "
                f"{config.final_logit_softcapping:g}), and the loss reads the capped ones")
    return None


def _chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor | None, *,
                          ignore_index: int = -100, num_items_in_batch=None,
                          shift_labels: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """ForCausalLMLoss(head(hidden), labels) without the logits: see the module docstring."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    width = hidden.shape[-1]
    flat, target = hidden.reshape(-1, width), shift_labels.reshape(-1).to(hidden.device)
    if flat.shape[0] != target.shape[0]:
        raise ValueError(f"chunked loss: {flat.shape[0]} rows of hidden states but {target.shape[0]} labels")
    step = rows or chunk_rows(flat.shape[0], width, _vocab(head, flat[:1]))
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], step):
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_loss, flat[start:start + step], target[start:start + step], head, ignore_index,
            use_reentrant=False)
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch)
                    else num_items_in_batch)


def _chunk_loss(rows: torch.Tensor, target: torch.Tensor, head: nn.Module, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(head(rows).float(), target, ignore_index=ignore_index, reduction="sum")


def _vocab(head: nn.Module, row: torch.Tensor) -> int:
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0]
    with torch.no_grad():
        return head(row).shape[-1]


class _HeadReturnsItsInput:
    """Within: the head's next call returns its input (appended to ``into``) and puts the head's own forward back;
    the loss function's chunks then call the head itself. An object, not two closures: closures that name each other
    form a cycle that would hold the hidden states (``into``) until the garbage collector runs, past the step's
    peak."""

    def __init__(self, head: nn.Module, into: list):
        self.head, self.into, self.had = head, into, head.__dict__.get("forward")

    def __enter__(self):
        self.head.forward = self._once
        return self

    def __exit__(self, *exc):
        self._restore()

    def _once(self, x, *args, **kwargs):
        self.into.append(x)
        self._restore()
        return x

    def _restore(self):
        if self.head.__dict__.get("forward") != self._once:
            return
        if self.had is None:
            del self.head.__dict__["forward"]
        else:
            self.head.forward = self.had


@contextlib.contextmanager
def _loss_function(model: nn.Module, loss_function):
    had = model.__dict__.get("_loss_function")
    model.loss_function = loss_function  # transformers' setter: the model's own forward calls it with its logits
    try:
        yield
    finally:
        if had is None:
            model.__dict__.pop("_loss_function", None)
        else:
            model.loss_function = had


def apply_chunked_loss(model: nn.Module, rows: int | None = None) -> nn.Module:
    """In place: ``model``'s training calls with labels compute the chunked loss (module docstring); ``rows`` per
    chunk (default :func:`chunk_rows`). The model's own forward runs with its labels and computes its own loss —
    auxiliary losses (an MoE's router_aux_loss_coef · aux_loss), ``num_items_in_batch``, ``shift_labels``,
    ``ignore_index`` — with its ``loss_function`` computing the cross-entropy chunk by chunk from what the head was
    given; its signature stays visible (``inspect.signature``: Trainer's column filter), ``return_dict=False`` gives
    the stock tuple with None for the logits. Raises :class:`NotChunked` with the reason where it cannot apply."""
    if (why := refusal(model)) is not None:
        raise NotChunked(f"chunked loss: {why}")
    if _APPLIED not in model.__dict__:
        model.__dict__[_APPLIED] = install_forward(model, _chunked_forward, rows, inspect.signature(model.forward))
    return model


def _chunked_forward(model: nn.Module, inner, rows: int | None, signature: inspect.Signature, *args, **kwargs):
    """The forward :func:`apply_chunked_loss` installs (``inner``: the model's forward before it, ``signature``
    its signature, read once)."""
    given = signature.bind_partial(*args, **kwargs).arguments
    if given.get("labels") is None or not torch.is_grad_enabled() or given.get("logits_to_keep") not in (0, None):
        return inner(*args, **kwargs)
    head, seen, handed = model.get_output_embeddings(), [], []  # the head as it is now (a rewrite may replace it)

    def chunked(logits, labels, vocab_size=None, **loss_kwargs):  # the model's loss_function (its own names)
        handed.append(logits)
        return _chunked_cross_entropy(logits, head, labels, rows=rows,
                                     **{k: loss_kwargs[k] for k in _LOSS_ARGS if k in loss_kwargs})

    as_tuple = kwargs.get("return_dict") is False
    if as_tuple:
        kwargs["return_dict"] = True
    with _HeadReturnsItsInput(head, seen), _loss_function(model, chunked):
        out = inner(*args, **kwargs)
    if not seen and not handed:  # the call computed its loss without the head module (TRL's fused-head loss,
        return out               # itself a chunked loss): the model's own result, as it is
    unchanged = len(seen) == len(handed) == 1 and handed[0] is seen[0]
    if not unchanged or getattr(out, "logits", None) is not seen[0]:
        raise RuntimeError(f"chunked loss: {type(model).__name__} changes its logits after the head (or calls "
                           "it more than once, or computes its loss otherwise); remove it with "
                           "approxbp.planner.chunked_loss.remove_chunked_loss")
    if as_tuple:  # the stock tuple (its None fields left out, as transformers does), the logits' place kept
        return tuple(None if k == "logits" else v for k, v in out.items())
    return _without_logits(type(out))(**{k: v for k, v in out.items() if k != "logits"})


#: Reading ``outputs.logits`` of a chunked call: the error says why there are none and how to have them.
NO_LOGITS = ("approxbp's chunked loss computed this loss a chunk of tokens at a time and made no logits (that is the "
             "move); code that reads outputs.logits in training (a compute_loss of your own) needs the move off: "
             "ApproxBPCallback(..., chunked_loss=False), or a plan without it")
_LOGITLESS: dict[type, type] = {}


def _without_logits(output_type: type) -> type:
    """``output_type`` (a transformers ``ModelOutput``) whose ``logits`` raise :data:`NO_LOGITS` when read, rather
    than reading None and failing later on a None (``getattr(out, "logits", None)`` still reads None)."""
    if output_type not in _LOGITLESS:
        def logits(self):
            raise AttributeError(NO_LOGITS)

        def set_logits(self, value):
            if value is not None:
                raise AttributeError(NO_LOGITS)

        def shown(self):  # the dataclass repr would read the logits
            fields = ", ".join(f"{k}={v!r}" for k, v in self.items())
            return f"{output_type.__name__}({fields}, logits=<not made: approxbp's chunked loss>)"

        _LOGITLESS[output_type] = type(output_type.__name__, (output_type,), {
            "logits": property(logits, set_logits), "__repr__": shown, "__module__": output_type.__module__,
            "__doc__": f"{output_type.__name__} of a chunked-loss call: no logits (approxbp.planner.chunked_loss)"})
    return _LOGITLESS[output_type]


def remove_chunked_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_chunked_loss`."""
    uninstall_forward(model, model.__dict__.pop(_APPLIED, None))
    return model
