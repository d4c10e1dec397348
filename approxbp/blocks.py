"""Reference transformer blocks for memory accounting (Approx-BP Figs. 5–6): a ViT-B block (LayerNorm, GELU MLP)
and a LLaMA-style block (RMSNorm, SwiGLU), each convertible to MS-norms + ReLU-sum or InvAct activations, and
their saved-for-backward bytes per token per hidden unit, measured with saved_tensors_hooks.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from approxbp.kernels.ops.invact import InvActGELU, InvActSiLU
from approxbp.kernels.ops.relu_sum import ReGELU2, ReSiLU2
from approxbp.kernels.ops.saved import saved_bytes
from approxbp.kernels.ops.torch_private import dynamo_reset
from approxbp.kernels.rewrite.norm_merge import merge_norm

__all__ = ["Attention", "gpt_block", "GPTBlock", "llama_block", "LlamaBlock", "MODES", "own_rng",
           "saved_per_token_per_d", "ToyGPT", "VARIANTS", "vit_b", "ViTBlock"]


VARIANTS = ("baseline", "compiled", "relu-sum", "invact")


def own_rng(fn):
    """Run ``fn`` on a fork of the global CPU RNG: the seed it sets (for a reproducible initialisation) leaves the
    caller's random stream as it was."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)
    return run


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v, o projections (so that a norm can merge into q, k, v);
    ``causal`` masks the future (language models)."""

    def __init__(self, d, heads, causal: bool = False):
        super().__init__()
        self.heads, self.causal, self.q, self.k, self.v, self.o = heads, causal, *(nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (m(x).view(B, T, self.heads, D // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(att.transpose(1, 2).reshape(B, T, D))


class ViTBlock(nn.Module):
    def __init__(self, d=768, hidden=3072, heads=12):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    def ours(self, activation: str = "relu-sum"):
        """MS-LayerNorms merged into q, k, v and fc1; GELU → ReGELU2 (``relu-sum``) or InvActGELU (``invact``)."""
        self.ln1 = merge_norm(self.ln1, [self.attn.q, self.attn.k, self.attn.v])
        self.ln2 = merge_norm(self.ln2, [self.fc1])
        self.act = ReGELU2() if activation == "relu-sum" else InvActGELU()
        return self


class GPTBlock(nn.Module):
    """Pre-norm GPT block with f(x) = attn(LN₁ x) and g(u) = fc2(GELU(fc1(LN₂ u))) (each followed by dropout when
    ``dropout`` > 0): ``forward`` is x + f, then + g; ``branch`` is the same block as one residual increment
    h(x) = f(x) + g(x + f(x)) (BDIA-transformer eq. 4), what a BDIA stack runs."""

    def __init__(self, d=128, hidden=512, heads=4, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads, causal), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()  # p = 0 saves no mask

    def attend(self, x):
        return self.drop(self.attn(self.ln1(x)))

    def mlp(self, u):
        return self.drop(self.fc2(self.act(self.fc1(self.ln2(u)))))

    def forward(self, x):
        x = x + self.attend(x)
        return x + self.mlp(x)

    def branch(self, x):
        f = self.attend(x)
        return f + self.mlp(x + f)

    ours = ViTBlock.ours


class _Branch(nn.Module):
    """A GPTBlock as its residual increment h (for BDIAStack, which adds the residual itself)."""

    def __init__(self, block: GPTBlock):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.branch(x)


class ToyGPT(nn.Module):
    """The toy transformer the experiments and benchmarks train: token and position embeddings, ``blocks`` causal
    GPTBlocks (hidden 4d), a final LayerNorm and the head. ``bdia_level``: run the blocks as a BDIA stack
    (γ ∈ {±0.5}, quantisation level l; ``approxbp.kernels.ops.bdia``) instead of the plain residual stack."""

    def __init__(self, vocab: int, d: int = 128, blocks: int = 6, heads: int = 4, context: int = 64,
                 dropout: float = 0.0, bdia_level: int | None = None):
        super().__init__()
        from approxbp.kernels.ops.bdia import BDIAStack

        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        layers = [GPTBlock(d, 4 * d, heads, causal=True, dropout=dropout) for _ in range(blocks)]
        self.bdia = bdia_level is not None
        self.stack = BDIAStack([_Branch(b) for b in layers], level=bdia_level) if self.bdia else nn.Sequential(*layers)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx, seed: int | None = None):
        """Logits for token ids ``idx`` [batch, tokens]; ``seed`` draws the BDIA γ (ignored by the plain stack)."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.stack(x, seed=seed) if self.bdia else self.stack(x)))


class LlamaBlock(nn.Module):
    def __init__(self, d=1024, hidden=2752, heads=16):
        super().__init__()
        self.n1, self.attn, self.n2 = nn.RMSNorm(d, eps=1e-6), Attention(d, heads), nn.RMSNorm(d, eps=1e-6)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down, self.act = nn.Linear(hidden, d, bias=False), nn.SiLU()

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))

    def ours(self, activation: str = "relu-sum"):
        """MS-RMSNorms merged into q, k, v and gate, up; SiLU → ReSiLU2 or InvActSiLU."""
        self.n1 = merge_norm(self.n1, [self.attn.q, self.attn.k, self.attn.v])
        self.n2 = merge_norm(self.n2, [self.gate, self.up])
        self.act = ReSiLU2() if activation == "relu-sum" else InvActSiLU()
        return self


MODES = ("bf16", "autocast", "compile")


def _for_planner(block_cls):
    """A ``module:approxbp.blocks:<name>`` factory for ``approxbp plan``: the block and its input x(b, n), which
    requires grad as a block's input inside a network does."""
    def factory():
        block = block_cls()
        d = block.attn.q.in_features
        return block, lambda b, n: {"x": torch.randn(b, n, d, requires_grad=True)}
    factory.__doc__ = f"{block_cls.__name__} for approxbp plan (module:approxbp.blocks:…)."
    return factory


vit_b, llama_block, gpt_block = _for_planner(ViTBlock), _for_planner(LlamaBlock), _for_planner(GPTBlock)


@own_rng
def saved_per_token_per_d(block_cls, variant: str, frozen: bool, tokens=197, batch=2, dtype=torch.bfloat16,
                          mode: str = "bf16", **block_kwargs) -> float:
    """Saved-for-backward bytes / (tokens · d) of one block (saved_tensors_hooks, parameters excluded).

    ``variant``: ``baseline`` (torch modules), ``relu-sum`` or ``invact`` (MS-norms merged + that activation),
    ``compiled`` (= baseline with ``mode='compile'``); ``frozen``: linear weights without gradient (LoRA-like).
    ``mode``: ``bf16`` (weights and input in ``dtype``, eager), ``autocast`` (fp32 weights and input under
    ``torch.autocast(dtype)``, eager) or ``compile`` (``dtype`` weights under torch.compile: the hooks see what
    AOTAutograd's partitioner saves, inductor's without its code generation)."""
    if variant == "compiled":
        variant, mode = "baseline", "compile"
    if variant not in ("baseline", "relu-sum", "invact") or mode not in MODES:
        raise ValueError(f"variant must be one of {VARIANTS} and mode one of {MODES}, got {variant!r}, {mode!r}")
    torch.manual_seed(0)
    block = block_cls(**block_kwargs)
    if variant != "baseline":
        block.ours(variant)
    weights = torch.float32 if mode == "autocast" else dtype
    block = block.to(weights)
    for p in block.parameters():
        p.requires_grad_(not frozen)
    d = block.attn.q.in_features
    x = torch.randn(batch, tokens, d, dtype=weights, requires_grad=True)
    run = block
    if mode == "compile":  # inductor's min-cut partitioner without its code generation: the saved tensors of an
        dynamo_reset()     # inductor compile (tests/approxbp/planner/test_plan.py compares the two on each block)
        run = torch.compile(block, backend="aot_eager_decomp_partition")
        run(x)  # compile outside the measurement

    def step():
        with torch.autocast("cpu", dtype, enabled=mode == "autocast"):
            return run(x)

    return saved_bytes(step, exclude=list(block.parameters())) / (batch * tokens * d)
