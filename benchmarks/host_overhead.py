"""Host time per call (forward + backward) of each drop-in against the torch module it replaces.

    python benchmarks/host_overhead.py [--out benchmarks/results/host_overhead_cpu.json]

On tiny tensors (8×8 fp32) the kernels' work is negligible, so the time is what the host spends: Python, the
dispatcher, autograd. On the CPU the drop-ins run their pure-PyTorch twins, several ATen ops each, so this
bounds the *twin* path; the CUDA path's cost (Triton's launcher) needs a GPU and is measured by
benchmarks/gpu_kernels.py when one is lent. Median of 7 repeats of 500 calls, after 100 warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from approxbp.approximations.files import write_atomic
from approxbp.kernels import InvActGELU, InvActSiLU, MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2

PAIRS = [("GELU → ReGELU2", torch.nn.GELU, ReGELU2), ("SiLU → ReSiLU2", torch.nn.SiLU, ReSiLU2),
         ("GELU → InvActGELU", torch.nn.GELU, InvActGELU), ("SiLU → InvActSiLU", torch.nn.SiLU, InvActSiLU),
         ("LayerNorm → MSLayerNorm", lambda: torch.nn.LayerNorm(8, elementwise_affine=False), lambda: MSLayerNorm(8)),
         ("RMSNorm → MSRMSNorm", lambda: torch.nn.RMSNorm(8, elementwise_affine=False), lambda: MSRMSNorm(8))]


def median_us(fn, calls=500, repeats=7) -> float:
    """Median over ``repeats`` of the mean host time of ``calls`` calls of ``fn``, after 100 warm-up calls."""
    for _ in range(100):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def per_call_us(module, x) -> float:
    """Forward + backward."""
    g = torch.ones_like(x)
    return median_us(lambda: module(x).backward(g))


def forward_us(module, x) -> float:
    """A forward without grad (inference)."""
    with torch.no_grad():
        return median_us(lambda: module(x))


def entry_points_us(rounds=15, calls=200) -> dict:
    """Forward+backward through the custom op (what dynamo traces) against the eager autograd.Function (what the
    drop-ins call outside dynamo), interleaved, best of ``rounds``: the custom op's own dispatch cost."""
    from approxbp.kernels.ops import invact, norms, relu_sum

    x = torch.randn(8, 8, requires_grad=True)
    g = torch.ones_like(x)
    r, i = ReGELU2(), InvActGELU()
    paths = {
        ("ReGELU2", "custom op"): lambda: relu_sum.relu_sum_forward(x, r.spec.key, False)[0].backward(g),
        ("ReGELU2", "eager Function"): lambda: relu_sum.dispatch(x, r.spec, False).backward(g),
        ("InvActGELU", "custom op"): lambda: invact.invact_forward(x, i.spec.key, False, None)[0].backward(g),
        ("InvActGELU", "eager Function"): lambda: invact.dispatch(x, i.spec, False, None).backward(g),
        ("MSLayerNorm", "custom op"): lambda: norms.ms_norm_forward(x, 1e-5, True, False, None)[0].backward(g),
        ("MSLayerNorm", "eager Function"): lambda: norms.dispatch(x, 1e-5, True, False, None).backward(g),
    }
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(rounds):
        for key, fn in paths.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[key] = min(best[key], (time.perf_counter() - t0) / calls * 1e6)
    return {f"{op} via {path}": round(us, 1) for (op, path), us in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_overhead_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(8, 8, requires_grad=True)
    rows = []
    for name, ref, ours in PAIRS:
        t_ref, t_ours = per_call_us(ref(), x), per_call_us(ours(), x)
        f_ref, f_ours = forward_us(ref(), x), forward_us(ours(), x)
        rows.append({"op": name, "torch_us": round(t_ref, 1), "ours_us": round(t_ours, 1),
                     "ratio": round(t_ours / t_ref, 2), "no_grad_forward_torch_us": round(f_ref, 1),
                     "no_grad_forward_ours_us": round(f_ours, 1), "no_grad_ratio": round(f_ours / f_ref, 2)})
        print(f"{name:<26} fwd+bwd: torch {t_ref:7.1f} µs, ours {t_ours:7.1f} µs (×{t_ours / t_ref:.2f});   "
              f"no-grad fwd: torch {f_ref:6.1f} µs, ours {f_ours:6.1f} µs (×{f_ours / f_ref:.2f})")
    entry = entry_points_us()
    for k, v in entry.items():
        print(f"{k:<34} {v:7.1f} µs")
    out = {"benchmark": "host time per call, 8×8 fp32, twin path (eager autograd.Function)", "device": "cpu",
           "machine": platform.machine(), "torch": torch.__version__,
           "command": "python benchmarks/host_overhead.py", "rows": rows, "entry_points_fwd_bwd_us": entry}
    write_atomic(args.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
