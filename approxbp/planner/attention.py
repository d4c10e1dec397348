"""Attention and dropout as a GPU runs them, for the planner.

On a CPU, ``F.scaled_dot_product_attention`` with dropout takes the math path and keeps the n × n attention
probabilities and the dropout mask for backward; a GPU's fused kernels (flash, memory-efficient) take dropout and
keep only q, k, v, the output, one fp32 log-sum-exp per query row, the additive mask if there is one, and the RNG
seed and offset from which the backward regenerates the dropout mask. :func:`gpu_attention` makes every such call
keep exactly that, so a plan made on a CPU (fake tensors or real ones) counts what CUDA would save. Without dropout
the CPU already runs its fused kernel, which keeps the same set (less the RNG state): nothing is changed then.

This is a memory model: the values are the CPU's (the backward recomputes attention with a fresh dropout mask).

Dropout itself differs the same way: on a CPU ``F.dropout`` multiplies by a mask of the input's dtype and keeps that
mask (4 bytes per fp32 element), while CUDA runs ``native_dropout``, which keeps a 1-byte bool mask.
:func:`gpu_dropout` runs ``native_dropout`` where CUDA would (training, 0 < p < 1, not in place), so the mask counted
is the GPU's. RoBERTa at batch 32 and 256 tokens keeps 1.27 GiB less for it (Table 4).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from approxbp.planner.compat import swapped

__all__ = ["as_a_gpu_runs_it", "gpu_attention", "gpu_dropout", "RNG_STATE_BYTES"]


#: The functions the planner replaces, kept to run the attention and the dropout themselves.
_SDPA = F.scaled_dot_product_attention
_DROPOUT = F.dropout
#: Bytes of the RNG state a fused kernel with dropout keeps (a seed and an offset, int64 each).
RNG_STATE_BYTES = 16


class _FusedAttentionWithDropout(torch.autograd.Function):
    """Saves (q, k, v, out, lse, rng state[, mask]) as CUDA's fused SDPA does with dropout; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, mask, options):
        with torch.no_grad():
            out = _SDPA(q, k, v, attn_mask=mask, **options)
        if out.dim() == 4:  # laid out (batch, tokens, heads, d) as the fused kernels write it, so that the usual
            out = out.transpose(1, 2).contiguous().transpose(1, 2)  # transpose + reshape after it is a view
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        rng = q.new_empty(RNG_STATE_BYTES // 8, dtype=torch.int64)
        ctx.save_for_backward(q, k, v, out, lse, rng, *([mask] if mask is not None else []))
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _, _, *mask = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            out = _SDPA(*leaves, attn_mask=mask[0] if mask else None, **ctx.options)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, dout) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None)


def _as_a_gpu_runs_it(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **rest):
    options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, **rest)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if dropout_p > 0 and grads:
        return _FusedAttentionWithDropout.apply(query, key, value, attn_mask, options)
    return _SDPA(query, key, value, attn_mask=attn_mask, **options)


@contextlib.contextmanager
def gpu_attention():
    """Within it, ``F.scaled_dot_product_attention`` with dropout keeps for backward what CUDA's fused kernels keep
    (Hugging Face's attention calls it through ``torch.nn.functional``, so every model's SDPA path is covered)."""
    with swapped(F, "scaled_dot_product_attention", _as_a_gpu_runs_it):
        yield


def _dropout_as_a_gpu_runs_it(input, p=0.5, training=True, inplace=False):
    if training and 0 < p < 1 and not inplace and input.numel() and torch.is_grad_enabled():
        return torch.native_dropout(input, p, True)[0]  # CUDA's at::dropout takes this fused path
    return _DROPOUT(input, p, training, inplace)


@contextlib.contextmanager
def gpu_dropout():
    """Within it, ``F.dropout`` (and so ``nn.Dropout``) keeps CUDA's 1-byte bool mask for backward, not the CPU's
    mask in the input's dtype; the values are a dropout's all the same."""
    with swapped(F, "dropout", _dropout_as_a_gpu_runs_it):
        yield


@contextlib.contextmanager
def as_a_gpu_runs_it():
    """:func:`gpu_attention` and :func:`gpu_dropout` together: what the planner counts is what CUDA keeps."""
    with gpu_attention(), gpu_dropout():
        yield
