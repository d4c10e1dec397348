"""Saved-for-backward bytes of one transformer block in each training mode, measured with saved_tensors_hooks (CPU).

    python benchmarks/memory_blocks.py [--out benchmarks/results/memory_blocks_cpu.json]

Blocks (approxbp.blocks): ViT-B (d=768, MLP 3072, LayerNorm + GELU), LLaMA-style (d=1024, SwiGLU
2752, RMSNorm + SiLU) and a small GPT block (d=128, MLP 512, LayerNorm + GELU). Variants: exact (torch modules),
ReLU-sum (ReGELU2/ReSiLU2 + MS-norms merged into their consumers) and InvAct (InvActGELU/InvActSiLU + the same
MS-norms). Modes: ``bf16`` (bf16 weights, eager), ``autocast`` (fp32 weights under torch.autocast(bf16), eager),
``compile`` (bf16 weights, torch.compile: the hooks see what AOTAutograd's partitioner saves). "frozen" = linear
weights without gradient (LoRA-like), "trainable" = full fine-tuning. Parameters (and, under autocast, their
bf16 copies) are what they are in every variant; unit: saved bytes / (tokens · d).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from approxbp.approximations.files import write_atomic

from approxbp.blocks import MODES, GPTBlock, LlamaBlock, ViTBlock, saved_per_token_per_d

BLOCKS = (("vit-b", ViTBlock), ("llama-style", LlamaBlock), ("gpt-d128", GPTBlock))
VARIANTS = ("baseline", "relu-sum", "invact")


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_blocks_cpu.json")
    ap.add_argument("--tokens", type=int, default=197)
    args = ap.parse_args()
    rows = []
    print(f"{'block':<12} {'linears':<9} {'mode':<9} " + " ".join(f"{v:>9}" for v in VARIANTS) + "   saving")
    for name, cls in BLOCKS:
        for frozen in (True, False):
            for mode in MODES:
                vals = {v: saved_per_token_per_d(cls, v, frozen, tokens=args.tokens, mode=mode) for v in VARIANTS}
                rows.append({"block": name, "linears": "frozen" if frozen else "trainable", "mode": mode,
                             **{f"{v}_bytes_per_token_per_d": round(b, 4) for v, b in vals.items()},
                             "relu_sum_reduction": round(1 - vals["relu-sum"] / vals["baseline"], 4),
                             "invact_reduction": round(1 - vals["invact"] / vals["baseline"], 4)})
                print(f"{name:<12} {rows[-1]['linears']:<9} {mode:<9} "
                      + " ".join(f"{vals[v]:9.3f}" for v in VARIANTS)
                      + f"   {rows[-1]['relu_sum_reduction']:.1%} / {rows[-1]['invact_reduction']:.1%}")
    out = {"benchmark": "saved-for-backward bytes per block (saved_tensors_hooks)", "device": "cpu",
           "dtype": "bfloat16", "tokens": args.tokens, "batch": 2, "machine": platform.machine(),
           "torch": torch.__version__, "command": "python benchmarks/memory_blocks.py", "rows": rows}
    write_atomic(args.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
