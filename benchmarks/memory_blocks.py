"""Saved-for-backward bytes of one transformer block, measured with saved_tensors_hooks (CPU, bf16).

    python benchmarks/memory_blocks.py [--out benchmarks/results/memory_blocks_cpu.json]

ViT-B block (d=768, MLP 3072, LayerNorm + GELU) and LLaMA-style block (d=4096 scaled down to d=1024,
SwiGLU with 2.6875·d, RMSNorm + SiLU), each as the baseline (torch modules) and as ours (ReGELU2 /
ReSiLU2 + MS-LayerNorm / MS-RMSNorm merged into their consumers) and as InvAct (InvActGELU / InvActSiLU +
the same MS-norms). The blocks live in approxbp.kernels.blocks. "frozen" = linear weights without
gradient (LoRA-like: a frozen Linear still saves nothing for its weight), "trainable" = full fine-tuning.
Parameters are excluded. Result unit: bytes per token per hidden unit (saved bytes / (tokens · d)).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from approxbp.approximations.files import write_atomic
from approxbp.kernels.blocks import LlamaBlock, ViTBlock, saved_per_token_per_d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_blocks_cpu.json")
    args = ap.parse_args()
    rows = []
    for name, cls in (("vit-b", ViTBlock), ("llama-style", LlamaBlock)):
        for frozen in (True, False):
            base, comp, ours, inv = (saved_per_token_per_d(cls, v, frozen)
                                     for v in ("baseline", "compiled", "relu-sum", "invact"))
            rows.append({"block": name, "linears": "frozen" if frozen else "trainable",
                         "baseline_bytes_per_token_per_d": round(base, 4),
                         "torch_compile_bytes_per_token_per_d": round(comp, 4),
                         "ours_bytes_per_token_per_d": round(ours, 4),
                         "invact_bytes_per_token_per_d": round(inv, 4), "reduction": round(1 - ours / base, 4),
                         "invact_reduction": round(1 - inv / base, 4)})
            print(f"{name:<12} {rows[-1]['linears']:<9} baseline {base:7.3f}  compiled {comp:7.3f}  "
                  f"relu-sum {ours:7.3f}  invact {inv:7.3f}")
    out = {"benchmark": "saved-for-backward bytes per block (saved_tensors_hooks)", "device": "cpu",
           "dtype": "bfloat16", "tokens": 197, "batch": 2, "machine": platform.machine(),
           "command": "python benchmarks/memory_blocks.py", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
