"""GPU benchmark (issue 4 §8): kernel throughput and peak training memory. CUDA only — it refuses to run on the
CPU, because an interpreter timing says nothing about kernel speed.

    python benchmarks/gpu_kernels.py [--out benchmarks/results] [--numel 67108864] [--dtype bfloat16]

Throughput: forward and backward time (triton.testing.do_bench, median) of ReGELU2, InvActGELU, ReSiLU2,
InvActSiLU, MS-LayerNorm and MS-RMSNorm against torch eager, torch.compile and Liger-Kernel (when installed);
GB/s counts the bytes each implementation must move (reads + writes) and is compared with a measured
device-to-device copy. Peak memory: one training step (forward, backward, AdamW) of a small ViT and a small
LLaMA (random init, Hugging Face classes), unpatched vs patch_model(relu-sum) vs patch_model(invact).
Writes gpu_kernels_<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
from pathlib import Path

import torch
from approxbp.approximations.files import write_atomic


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e-3  # seconds


def copy_bandwidth(numel: int, dtype) -> float:
    x = torch.empty(numel, dtype=dtype, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _bench(lambda: y.copy_(x))


def _fwd_bwd(make, x, g):
    """(forward seconds, backward seconds) of y = make(x) with grad g; backward timed on a retained graph."""
    xr = x.detach().requires_grad_(True)
    fwd = _bench(lambda: make(xr))
    y = make(xr)
    bwd = _bench(lambda: torch.autograd.grad(y, xr, g, retain_graph=True))
    return fwd, bwd


def activation_rows(numel: int, dtype) -> list[dict]:
    from approxbp.kernels import InvActGELU, InvActSiLU, ReGELU2, ReSiLU2

    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(numel, dtype=dtype, device="cuda")
    g = torch.randn_like(x)
    rows = []
    for name, exact, ours in (("gelu", torch.nn.GELU(), {"ReGELU2": ReGELU2(), "InvActGELU": InvActGELU()}),
                              ("silu", torch.nn.SiLU(), {"ReSiLU2": ReSiLU2(), "InvActSiLU": InvActSiLU()})):
        impls = {"torch eager": (exact, 2 * e, 3 * e), "torch.compile": (torch.compile(exact), 2 * e, 3 * e)}
        impls.update({k: (m, 2 * e + (0.25 if k.startswith("Re") else 0.125),  # bytes/element fwd, bwd
                          2 * e + (0.25 if k.startswith("Re") else 0.125) + (e if k.startswith("Inv") else 0))
                      for k, m in ours.items()})
        try:
            from liger_kernel.transformers.functional import liger_geglu, liger_swiglu

            glu = liger_geglu if name == "gelu" else liger_swiglu
            ones = torch.ones_like(x)
            impls["liger (GLU with b = 1)"] = (lambda t, glu=glu, ones=ones: glu(t, ones), 3 * e, 5 * e)
        except ImportError:
            pass
        for impl, (fn, fwd_bytes, bwd_bytes) in impls.items():
            f, b = _fwd_bwd(fn, x, g)
            rows.append({"op": name, "impl": impl, "numel": numel, "dtype": str(dtype), "forward_s": f,
                         "backward_s": b, "forward_GBps": fwd_bytes * numel / f / 1e9,
                         "backward_GBps": bwd_bytes * numel / b / 1e9})
    return rows


def norm_rows(rows_: int, d: int, dtype) -> list[dict]:
    from approxbp.kernels import MSLayerNorm, MSRMSNorm

    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(rows_, d, dtype=dtype, device="cuda")
    g = torch.randn_like(x)
    out = []
    for name, exact, ours in (("layernorm", torch.nn.LayerNorm(d, device="cuda", dtype=dtype), MSLayerNorm(d)),
                              ("rmsnorm", torch.nn.RMSNorm(d, device="cuda", dtype=dtype), MSRMSNorm(d))):
        impls = {"torch eager": exact, "torch.compile": torch.compile(exact), f"MS-{name}": ours}
        if name == "rmsnorm":
            try:
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                impls["liger"] = LigerRMSNorm(d).to("cuda", dtype)
            except ImportError:
                pass
        for impl, fn in impls.items():
            f, b = _fwd_bwd(fn, x, g)
            n = rows_ * d
            out.append({"op": name, "impl": impl, "shape": [rows_, d], "dtype": str(dtype), "forward_s": f,
                        "backward_s": b, "forward_GBps": 2 * e * n / f / 1e9, "backward_GBps": 3 * e * n / b / 1e9})
    return out


def peak_memory_rows(dtype) -> list[dict]:
    import transformers
    from approxbp.kernels.patch import patch_model

    def vit():
        cfg = transformers.ViTConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                                     intermediate_size=1536, image_size=224, patch_size=16, num_labels=100)
        model = transformers.ViTForImageClassification(cfg)
        batch = {"pixel_values": torch.randn(64, 3, 224, 224), "labels": torch.randint(0, 100, (64,))}
        return model, batch, {"pixel_values": batch["pixel_values"][:2]}

    def llama():
        cfg = transformers.LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                       num_key_value_heads=8, intermediate_size=1376, vocab_size=32000)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 32000, (16, 512))
        return model, {"input_ids": ids, "labels": ids}, {"input_ids": ids[:1, :16]}

    out = []
    for name, build in (("vit-small", vit), ("llama-small", llama)):
        torch.manual_seed(0)
        base, batch, example = build()
        for variant in ("unpatched", "relu-sum", "invact"):
            model = copy.deepcopy(base)
            if variant != "unpatched":
                patch_model(model, activation=variant, example_input=example)
            model = model.to("cuda", dtype)
            b = {k: (v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda")) for k, v in batch.items()}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(2):  # the second step includes the optimizer state
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                model(**b).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            out.append({"model": name, "variant": variant, "dtype": str(dtype),
                        "peak_bytes": torch.cuda.max_memory_allocated()})
            del model, opt
            torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--numel", type=int, default=1 << 26)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py measures CUDA kernels; no CUDA device here (CPU timings are not kernel "
                         "speeds — see benchmarks/memory_blocks.py for the CPU memory accounting)")
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
              "copy_GBps": copy_bandwidth(args.numel, dtype) / 1e9,
              "activations": activation_rows(args.numel, dtype), "norms": norm_rows(args.numel // 4096, 4096, dtype),
              "peak_memory": peak_memory_rows(dtype)}
    for r in result["activations"] + result["norms"]:
        r["backward_fraction_of_copy"] = r["backward_GBps"] / result["copy_GBps"]
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"\W+", "_", device).strip("_").lower()
    path = args.out / f"gpu_kernels_{slug}.json"
    write_atomic(path, json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
