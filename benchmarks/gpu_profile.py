"""Where a patched step's time goes on a GPU: kernel time against the autograd call around it, and a profile of
the ViT-B LoRA step (benchmarks/gpu_kernels.py measures the totals). CUDA only for numbers; ``--smoke`` runs every
code path on tiny CPU tensors and writes nothing (the tests use it).

    python benchmarks/gpu_profile.py [--out benchmarks/results] [--numel 67108864]

1. Kernel alone vs through autograd: each of our element-wise modules timed by calling its spec's Triton forward
   and backward directly (the kernel and its output allocation), and as gpu_kernels.py times it (module call;
   backward = (forward + backward) − forward through autograd). The difference is what the host adds when it
   cannot stay ahead of the GPU.
2. One ViT-B/16 LoRA r=4 step (batch 64, autocast bf16; exact, ReLU-sum, InvAct) under torch.profiler: wall time,
   GPU busy time (sum of kernel times), the kernels and host ops that take most, and host-device syncs.
Writes gpu_profile_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from approxbp.approximations.files import write_atomic

sys.path.insert(0, str(Path(__file__).parent))
import gpu_kernels as gk  # noqa: E402 - the shared timing helpers

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize")


def kernel_rows(numel: int, dtype, device) -> list[dict]:
    """Kernel alone (spec.forward_triton / backward_triton) and module through autograd, same tensors, same run."""
    from approxbp.kernels.ops.invact import InvActSpec

    x = torch.randn(max(numel // 4096, 1), 4096, dtype=dtype, device=device)
    g = torch.randn_like(x)
    use = device == "cuda" or None
    rows = []
    for name, m in gk.drop_ins(use).items():
        fwd_k, bwd_k = _kernel_calls(m.spec, x, g, use, InvActSpec)
        row = {"impl": name, "shape": list(x.shape), "dtype": str(dtype),
               "kernel_forward_s": gk._bench(fwd_k), "kernel_backward_s": gk._bench(bwd_k)}
        row["autograd_forward_s"], row["autograd_backward_s"] = gk._fwd_bwd(m, x, g)
        rows.append(row)
        if not gk.SMOKE:
            print(f"{name:<24} kernel fwd {row['kernel_forward_s'] * 1e3:7.3f} ms  bwd "
                  f"{row['kernel_backward_s'] * 1e3:7.3f} ms | autograd fwd {row['autograd_forward_s'] * 1e3:7.3f}"
                  f" ms  bwd {row['autograd_backward_s'] * 1e3:7.3f} ms", flush=True)
    gk._add_static_predictions(rows, dtype, gk.copy_bandwidth(numel, dtype, device), keys=("kernel_forward",
                                                                                            "kernel_backward"))
    return rows


def _kernel_calls(spec, x, g, use, invact_spec):
    """(forward, backward) callables of the spec's kernels alone (Triton on CUDA, the torch twin in --smoke)."""
    fwd = spec.forward_triton if use else spec.forward_torch
    bwd = spec.backward_triton if use else spec.backward_torch
    saved = fwd(x)
    if isinstance(spec, invact_spec):
        return (lambda: fwd(x)), (lambda: bwd(g, saved[0], saved[1]))
    return (lambda: fwd(x)), (lambda: bwd(g, saved[1], saved[2], x.numel()))


def _top(events, key, n=12) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key[:90], "calls": e.count, "total_us": getattr(e, key)} for e in rows]


def vit_profile(device, batch=64) -> list[dict]:
    """One profiled ViT-B LoRA step per variant (autocast bf16) after three warm-up steps."""
    import peft
    import transformers
    from approxbp.kernels import patch_model

    size = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
    if gk.SMOKE:
        size, batch = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 64}, 2
    cfg = transformers.ViTConfig(**size, image_size=224, patch_size=16, num_labels=100)
    pixels, labels = torch.randn(batch, 3, 224, 224, device=device), torch.randint(0, 100, (batch,), device=device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    out = []
    for variant in ("exact", "relu-sum", "invact"):
        torch.manual_seed(0)
        model = transformers.ViTForImageClassification(cfg)
        example = {"pixel_values": pixels[:1].cpu()}
        if variant != "exact":
            patch_model(model, family=variant, example_input=example)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query", "value", "q_proj", "v_proj"]))
        if variant != "exact":
            patch_model(model, family=None, example_input=example)
        model = model.to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(model=model, opt=opt):
            with torch.autocast(device, torch.bfloat16):
                loss = model(pixel_values=pixels, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        gk._sync()
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            step()
            gk._sync()
            wall = time.perf_counter() - t0
        ev = prof.key_averages()
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        row = {"variant": variant, "batch": batch, "wall_s": wall, "gpu_busy_s": sum(getattr(e, key) for e in ev) * 1e-6
               if device == "cuda" else None, "host_s": sum(e.self_cpu_time_total for e in ev) * 1e-6,
               "syncs": {e.key: e.count for e in ev if e.key in SYNCS},
               "top_gpu": _top(ev, key), "top_host": _top(ev, "self_cpu_time_total")}
        out.append(row)
        if not gk.SMOKE:
            print(f"vit {variant}: wall {wall * 1e3:.1f} ms, gpu busy {(row['gpu_busy_s'] or 0) * 1e3:.1f} ms, host "
                  f"{row['host_s'] * 1e3:.1f} ms, syncs {row['syncs']}", flush=True)
            print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
        del model, opt
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON")
    p.add_argument("--numel", type=int, default=1 << 26, help="elements per element-wise benchmark")
    p.add_argument("--smoke", action="store_true", help="run every code path on tiny CPU tensors; no numbers")
    args = p.parse_args()
    gk.SMOKE = args.smoke
    if not gk.SMOKE and not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py profiles CUDA kernels; no CUDA device here")
    device = "cpu" if gk.SMOKE else "cuda"
    result = {"device": "smoke (cpu)" if gk.SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__}
    result["kernels"] = kernel_rows(4096 * 4 if gk.SMOKE else args.numel, torch.bfloat16, device)
    result["vit_profile"] = vit_profile(device)
    if gk.SMOKE:
        print("smoke run: every section ran; nothing written")
        return 0
    slug = re.sub(r"\W+", "_", result["device"]).strip("_").lower()
    path = args.out / f"gpu_profile_{slug}.json"
    write_atomic(path, json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
