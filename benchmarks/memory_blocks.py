"""Saved-for-backward bytes of one transformer block, measured with saved_tensors_hooks (CPU, bf16).

    python benchmarks/memory_blocks.py [--out benchmarks/results/memory_blocks_cpu.json]

ViT-B block (d=768, MLP 3072, LayerNorm + GELU) and LLaMA-style block (d=4096 scaled down to d=1024,
SwiGLU with 2.6875·d, RMSNorm + SiLU), each as the baseline (torch modules) and as ours (ReGELU2 /
ReSiLU2 + MS-LayerNorm / MS-RMSNorm merged into their consumers). "frozen" = linear weights without
gradient (LoRA-like: a frozen Linear still saves nothing for its weight), "trainable" = full fine-tuning.
Parameters are excluded. Result unit: bytes per token per hidden unit (saved bytes / (tokens · d)).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from approxbp.kernels import ReGELU2, ReSiLU2, merge_norm, saved_bytes
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.q, self.k, self.v, self.o = heads, *(nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (m(x).view(B, T, self.heads, D // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


class ViTBlock(nn.Module):
    def __init__(self, d=768, hidden=3072, heads=12):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    def ours(self):
        self.ln1 = merge_norm(self.ln1, [self.attn.q, self.attn.k, self.attn.v])
        self.ln2 = merge_norm(self.ln2, [self.fc1])
        self.act = ReGELU2()
        return self


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

    def ours(self):
        self.n1 = merge_norm(self.n1, [self.attn.q, self.attn.k, self.attn.v])
        self.n2 = merge_norm(self.n2, [self.gate, self.up])
        self.act = ReSiLU2()
        return self


def measure(block_cls, ours: bool, frozen: bool, tokens=197, batch=2, dtype=torch.bfloat16) -> float:
    torch.manual_seed(0)
    block = block_cls()
    if ours:
        block.ours()
    block = block.to(dtype)
    for p in block.parameters():
        p.requires_grad_(not frozen)
    d = block.attn.q.in_features
    x = torch.randn(batch, tokens, d, dtype=dtype, requires_grad=True)
    bytes_ = saved_bytes(lambda: block(x), exclude=list(block.parameters()))
    return bytes_ / (batch * tokens * d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_blocks_cpu.json")
    args = ap.parse_args()
    rows = []
    for name, cls in (("vit-b", ViTBlock), ("llama-style", LlamaBlock)):
        for frozen in (True, False):
            base, ours = measure(cls, False, frozen), measure(cls, True, frozen)
            rows.append({"block": name, "linears": "frozen" if frozen else "trainable",
                         "baseline_bytes_per_token_per_d": round(base, 4), "ours_bytes_per_token_per_d": round(ours, 4),
                         "reduction": round(1 - ours / base, 4)})
            print(f"{name:<12} {rows[-1]['linears']:<9} baseline {base:7.3f}  ours {ours:7.3f}  "
                  f"(−{100 * rows[-1]['reduction']:.1f}%)")
    out = {"benchmark": "saved-for-backward bytes per block (saved_tensors_hooks)", "device": "cpu",
           "dtype": "bfloat16", "tokens": 197, "batch": 2, "machine": platform.machine(),
           "command": "python benchmarks/memory_blocks.py", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
