"""GPU benchmark: kernel throughput against copy bandwidth, and training steps in every mode people train in.
CUDA only for numbers: on the CPU it refuses, because an interpreter timing says nothing about kernel speed;
``--smoke`` runs every code path on tiny CPU tensors (torch.compile without inductor's CPU code) and writes nothing
(the tests use it).

    python benchmarks/gpu_kernels.py [--out benchmarks/results] [--numel 67108864] [--dtype bfloat16]

1. Element-wise kernels: forward and backward of ReGELU2 / ReLU-sum k=4 / InvActGELU, ReSiLU2 / InvActSiLU,
   the piecewise ones (exact InvAct ELU, ReLU-sum hard-swish k=2),
   MS-LayerNorm / MS-RMSNorm against torch eager, torch.compile and Liger-Kernel (when installed), on 2-D rows
   (numel/4096 × 4096). Backward is timed as (forward + backward) − forward with a fresh forward each time, so
   compiled graphs (whose buffers are donated) are timed the same way as eager ones. Reported: seconds, ratio to
   torch eager measured in the same run, and the fraction of the measured device-to-device copy bandwidth for
   the bytes each implementation must move.
2. Training steps (issue 10): a GPT-style model (d=1024, 8 blocks, LayerNorm, Linear→GELU→Linear, 16×1024
   tokens), one AdamW step: peak ``max_memory_allocated`` and step time in bf16 eager, fp32 + autocast(bf16)
   eager, and bf16 torch.compile; exact vs ReGELU2 + MS-norm vs InvAct + MS-norm.
3. The papers' headline (Approx-BP, LoRA r=4 on ViT-B/16, batch 64, 224², AdamW): peak memory and images/s,
   exact vs patched, in autocast, bf16 and bf16 torch.compile modes (needs transformers and peft).
Writes gpu_kernels_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch
from approxbp.approximations.files import write_atomic
from torch import nn

SMOKE = False


#: Our element-wise drop-ins, by the names the rows use, and the table behind each (the static prediction of
#: ``approxbp cost`` reads it too). ReGELU2 and friends are these tables' modules.
TABLES = {"ReGELU2": "relu_sum/gelu-k2-primitive.json", "ReLU-sum k=4": "relu_sum/gelu-k4-primitive.json",
          "InvActGELU": "invact/gelu-fast.json", "ReSiLU2": "relu_sum/silu-k2-primitive.json",
          "InvActSiLU": "invact/silu-fast.json", "InvActELU": "invact/elu-exact.json",
          "ReLU-sum hard-swish k=2": "relu_sum/hardswish-k2-primitive.json"}


def drop_ins(use_triton: bool | None = None) -> dict:
    """{row name: drop-in module} built from :data:`TABLES`."""
    from approxbp.kernels import InvActivation, ReLUSumActivation

    return {name: (InvActivation if path.startswith("invact/") else ReLUSumActivation)(
        path.removesuffix(".json"), use_triton=use_triton) for name, path in TABLES.items()}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bench(fn) -> float:
    """Median seconds of ``fn`` (triton.testing.do_bench on CUDA; a single call in --smoke mode)."""
    if SMOKE:
        fn()
        return float("nan")
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e-3


def _compile(fn):
    """``torch.compile(fn)``: inductor on a GPU; in --smoke mode AOTAutograd's graphs run eagerly (``aot_eager``), the
    same code path of this script without inductor's CPU code (C++ a GPU never runs, ~60 s of gcc per smoke run)."""
    return torch.compile(fn, backend="aot_eager") if SMOKE else torch.compile(fn)


def copy_bandwidth(numel: int, dtype, device) -> float:
    x = torch.empty(numel, dtype=dtype, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _bench(lambda: y.copy_(x))


def _fwd_bwd(make, x, g) -> tuple[float, float]:
    """(forward s, backward s): backward = (forward + backward with a fresh graph) − forward."""
    xr = x.detach().requires_grad_(True)

    def forward():
        with torch.no_grad():
            return make(xr)

    def both():
        xr.grad = None
        make(xr).backward(g)

    fwd = _bench(forward)
    both()  # compile/warm the backward
    return fwd, _bench(both) - _bench(lambda: make(xr))


def _rows(op, impls, x, g, copy_bps):
    """impls: name → (callable, forward bytes/elem, backward bytes/elem)."""
    out, n = [], x.numel()
    for impl, (fn, fb, bb) in impls.items():
        try:
            f, b = _fwd_bwd(fn, x, g)
        except Exception as err:  # noqa: BLE001 - one failing impl must not lose the others' numbers
            out.append({"op": op, "impl": impl, "error": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        out.append({"op": op, "impl": impl, "shape": list(x.shape), "dtype": str(x.dtype), "forward_s": f,
                    "backward_s": b, "forward_fraction_of_copy": fb * n / f / copy_bps,
                    "backward_fraction_of_copy": bb * n / b / copy_bps})
    eager = next((r for r in out if r["impl"] == "torch eager" and "forward_s" in r), None)
    for r in out:
        if eager and "forward_s" in r:
            r["forward_vs_eager"] = r["forward_s"] / eager["forward_s"]
            r["backward_vs_eager"] = r["backward_s"] / eager["backward_s"]
    return out


def activation_rows(numel: int, dtype, device, copy_bps) -> list[dict]:
    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(max(numel // 4096, 1), 4096, dtype=dtype, device=device)  # 2-D rows (Liger needs them)
    g = torch.randn_like(x)
    mods = drop_ins(device == "cuda" or None)
    rows = []
    for name, exact, bits_of in (("gelu", nn.GELU(), {"ReGELU2": 2, "ReLU-sum k=4": 4, "InvActGELU": 1}),
                                 ("silu", nn.SiLU(), {"ReSiLU2": 2, "InvActSiLU": 1}),
                                 ("elu", nn.ELU(), {"InvActELU": 1}),
                                 ("hardswish", nn.Hardswish(), {"ReLU-sum hard-swish k=2": 2})):
        ours = {k: (mods[k], bits) for k, bits in bits_of.items()}
        impls = {"torch eager": (exact, 2 * e, 3 * e), "torch.compile": (_compile(exact), 2 * e, 3 * e)}
        for k, (m, bits) in ours.items():
            saved = bits / 8 + (1 / 4096 if bits > 1 else 0)  # codes (+ NaN bytes) or branch bits
            impls[k] = (m, 2 * e + saved, 2 * e + saved + (e if bits == 1 else 0))  # InvAct reads y too
        try:
            from liger_kernel.transformers.functional import liger_geglu, liger_swiglu

            glu = {"gelu": liger_geglu, "silu": liger_swiglu}[name]
            ones = torch.ones_like(x)
            impls["liger (GLU with b = 1)"] = (lambda t, glu=glu, ones=ones: glu(t, ones), 3 * e, 5 * e)
        except (ImportError, KeyError):  # Liger has GLUs of GELU and SiLU only
            pass
        rows += _rows(name, impls, x, g, copy_bps)
    _add_static_predictions(rows, dtype, copy_bps)
    return rows


def glu_rows(numel: int, dtype, device, copy_bps) -> list[dict]:
    """act(g)·u: torch eager (saves g, act(g), u), torch.compile, our exact fused GLU (saves g, u) and Liger's
    SwiGLU/GeGLU. The benchmarked tensor holds g and u as its two contiguous halves (rows of 4096)."""
    import torch.nn.functional as F
    from approxbp.kernels.ops.glu import GLUSpec, glu

    e = torch.tensor([], dtype=dtype).element_size()
    rows_ = max(numel // 4096, 2) // 2
    x = torch.randn(2 * rows_, 4096, dtype=dtype, device=device)
    g = torch.randn(rows_, 4096, dtype=dtype, device=device)  # dh
    use = device == "cuda" or None
    out = []
    for name, act in (("swiglu", F.silu), ("geglu", F.gelu)):
        spec = GLUSpec("silu" if name == "swiglu" else "gelu")
        stock = lambda t, act=act: act(t[:rows_]) * t[rows_:]  # noqa: E731
        # bytes per element of the benchmarked tensor (g and u): forward 3, backward 5 per element of h
        impls = {"torch eager": (stock, 1.5 * e, 2.5 * e), "torch.compile": (_compile(stock), 1.5 * e, 2.5 * e),
                 "exact fused GLU": (lambda t, spec=spec: glu(t[:rows_], t[rows_:], spec, use), 1.5 * e, 2.5 * e)}
        try:
            from liger_kernel.transformers.functional import liger_geglu, liger_swiglu

            lig = liger_swiglu if name == "swiglu" else liger_geglu
            impls["liger"] = (lambda t, lig=lig: lig(t[:rows_], t[rows_:]), 1.5 * e, 2.5 * e)
        except ImportError:
            pass
        out += _rows(name, impls, x, g, copy_bps)
    return out


def correctness_rows(device, dtype) -> list[dict]:
    """Correct before fast: each of our GPU implementations against the pure-PyTorch reference path on the CPU
    (same module, same bf16/fp16/fp32 input upcast to float32), on fresh random data of an odd shape (tails of the
    grid included), outputs poisoned with NaN first. rel = ‖gpu − ref‖ / ‖ref‖ for y and for dx (dg, du)."""
    from approxbp.kernels import MSLayerNorm, MSRMSNorm
    from approxbp.kernels.ops.glu import GLUSpec, glu

    torch.manual_seed(1234)
    shape = (3, 1237) if SMOKE else (257, 4099)
    mods = drop_ins() | {"MS-layernorm": MSLayerNorm(shape[-1]), "MS-rmsnorm": MSRMSNorm(shape[-1])}
    calls = {k: (lambda t, m=m: m(t[0]), 1) for k, m in mods.items()}
    for name in ("silu", "gelu"):
        spec = GLUSpec(name)
        calls[f"exact fused GLU ({name})"] = (lambda t, spec=spec: glu(t[0], t[1], spec), 2)

    def run(fn, ins, g):
        ins = [t.detach().clone().requires_grad_(True) for t in ins]
        y = fn(ins)
        y.backward(g)
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in ins]

    out = []
    for name, (fn, n_in) in calls.items():
        ins = [torch.randn(shape, dtype=dtype) * 3 for _ in range(n_in)]
        g = torch.randn(shape, dtype=dtype)
        try:
            ref = run(fn, [t.float() for t in ins], g.float())
            got = run(fn, [t.to(device) for t in ins], g.to(device))
        except Exception as err:  # noqa: BLE001 - one failing implementation must not lose the others
            out.append({"impl": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        rel = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref, strict=True)]
        nan = any(bool(torch.isnan(a).any()) for a in got)
        out.append({"impl": name, "shape": list(shape), "dtype": str(dtype), "rel_y": rel[0], "rel_dx": rel[1:],
                    "any_nan": nan})
        if not SMOKE:
            print(f"check {name:<24} rel y {rel[0]:.2e}  rel dx {', '.join(f'{r:.2e}' for r in rel[1:])}"
                  f"{'  NaN!' if nan else ''}")
    return out




def _add_static_predictions(rows: list[dict], dtype, copy_bps: float, keys=("forward", "backward")) -> None:
    """Beside each measured time, the static model's (``approxbp cost``: SASS instructions per element for sm_90):
    n · max(bytes/element / measured copy bandwidth, instructions/element / issue rate). The ratio measured /
    predicted calibrates the model."""
    from approxbp import cost

    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    for r in rows:
        table = TABLES.get(r.get("impl"))
        if table is None or f"{keys[0]}_s" not in r:
            continue
        try:
            fwd, bwd = cost.run([table], name, extras=False, workers=1)[:2]  # then a user's plain exact pair
        except Exception as err:  # noqa: BLE001 - the measurement stands without its prediction
            r["static_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        n = r["shape"][0] * r["shape"][1]
        for key, k in zip(keys, (fwd, bwd), strict=True):
            predicted = n * max(k.bytes_per_element / copy_bps, k.instructions_per_element / cost.ISSUE_RATE)
            r[f"{key}_static"] = {"instructions_per_element": k.instructions_per_element, "ratio": k.ratio,
                                  "predicted_s": predicted}
            if not SMOKE:
                print(f"{r['impl']:<14} {key:<15} measured {r[f'{key}_s'] * 1e3:8.3f} ms   static prediction "
                      f"{predicted * 1e3:8.3f} ms   ({k.instructions_per_element:.1f} instr/elem, ratio {k.ratio:.2f})")


def norm_rows(rows_: int, d: int, dtype, device, copy_bps) -> list[dict]:
    from approxbp.kernels import MSLayerNorm, MSRMSNorm

    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(rows_, d, dtype=dtype, device=device)
    g = torch.randn_like(x)
    out = []
    for name, exact, ours in (("layernorm", nn.LayerNorm(d, device=device, dtype=dtype), MSLayerNorm(d)),
                              ("rmsnorm", nn.RMSNorm(d, device=device, dtype=dtype), MSRMSNorm(d))):
        impls = {"torch eager": (exact, 2 * e, 3 * e), "torch.compile": (_compile(exact), 2 * e, 3 * e),
                 f"MS-{name}": (ours, 2 * e, 3 * e)}
        if name == "rmsnorm":
            try:
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                impls["liger"] = (LigerRMSNorm(d).to(device, dtype), 2 * e, 3 * e)
            except ImportError:
                pass
        out += _rows(name, impls, x, g, copy_bps)
    return out


def _measure(step, device, steps) -> tuple[int | None, float | None]:
    """(peak bytes, seconds per step) after two warm-up steps (compilation; the optimizer state exists from the
    second step on). Both None in --smoke mode, where only the code path is exercised."""
    for _ in range(2):
        step()
    _sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(1 if SMOKE else steps):
        step()
    _sync()
    if SMOKE:
        return None, None
    return torch.cuda.max_memory_allocated(), (time.perf_counter() - t0) / steps


def training_step_rows(device, d=1024, blocks=8, batch=16, tokens=1024, steps=5) -> list[dict]:
    from approxbp.kernels import patch_model

    from approxbp.blocks import ToyGPT

    out = []
    ids = torch.randint(0, 32000, (batch, tokens), device=device)
    for mode in ("bf16", "autocast", "compile"):
        for variant in ("exact", "relu-sum", "invact"):
            torch.manual_seed(0)
            model = ToyGPT(32000, d, blocks, heads=d // 64, context=tokens)
            if variant != "exact":
                patch_model(model, family=variant)
            model = model.to(device, torch.float32 if mode == "autocast" else torch.bfloat16)
            run = _compile(model) if mode == "compile" else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(run=run, opt=opt, mode=mode):
                with torch.autocast(device, torch.bfloat16, enabled=mode == "autocast"):
                    logits = run(ids)
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            row = {"model": f"gpt d={d} × {blocks}", "tokens": batch * tokens, "mode": mode, "variant": variant}
            try:
                row["peak_bytes"], row["step_s"] = _measure(step, device, steps)
            except Exception as err:  # noqa: BLE001 - keep the other configurations' numbers
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            out.append(row)
            if not SMOKE:
                print("step", {k: v for k, v in row.items() if k != "model"}, flush=True)
            del model, run, opt
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


def vit_lora_rows(device, batch=64, steps=5, modes=("autocast", "bf16", "compile")) -> list[dict]:
    """Approx-BP's headline configuration: HF ViT-B/16 (random init), LoRA r=4 on query/value, AdamW; fp32 weights
    in autocast(bf16), bf16 weights eager, and bf16 weights under torch.compile."""
    try:
        import peft
        import transformers
    except ImportError as err:
        return [{"skipped": f"needs transformers and peft ({err})"}]
    from approxbp.kernels import patch_model

    size = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
    if SMOKE:
        size = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
        batch = 2
    cfg = transformers.ViTConfig(**size, image_size=224, patch_size=16, num_labels=100)
    pixels = torch.randn(batch, 3, 224, 224, device=device)
    labels = torch.randint(0, 100, (batch,), device=device)
    out = []
    for mode in modes:
        for variant in ("exact", "relu-sum", "invact"):
            torch.manual_seed(0)
            model = transformers.ViTForImageClassification(cfg)
            if variant != "exact":
                patch_model(model, family=variant, example_input={"pixel_values": pixels[:1].cpu()})
            lora = peft.LoraConfig(r=4, target_modules=["query", "value", "q_proj", "v_proj"])  # transformers 4 / 5
            model = peft.get_peft_model(model, lora)
            if variant != "exact":  # the adapters get the merged norms' α, β: exact LoRA gradients (README)
                patch_model(model, family=None, example_input={"pixel_values": pixels[:1].cpu()})
            model = model.to(device, torch.float32 if mode == "autocast" else torch.bfloat16)
            px = pixels.to(torch.float32 if mode == "autocast" else torch.bfloat16)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            run = _compile(model) if mode == "compile" else model

            def step(run=run, opt=opt, mode=mode, px=px):
                with torch.autocast(device, torch.bfloat16, enabled=mode == "autocast"):
                    loss = run(pixel_values=px, labels=labels).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            row = {"model": "vit-b/16 lora r=4", "batch": batch, "mode": mode, "variant": variant}
            try:
                peak, secs = _measure(step, device, steps)
                row.update(peak_bytes=peak, images_per_s=None if secs is None else batch / secs)
            except Exception as err:  # noqa: BLE001 - keep the other configurations' numbers
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            out.append(row)
            if not SMOKE:
                print("step", {k: v for k, v in row.items() if k != "model"}, flush=True)
            del model, run, opt
    return out


def main() -> int:
    global SMOKE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON")
    p.add_argument("--numel", type=int, default=1 << 26, help="elements per element-wise benchmark")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--skip", nargs="*", default=[], choices=("kernels", "training", "vit-lora"),
                   help="sections to leave out")
    p.add_argument("--vit-modes", nargs="*", default=["autocast", "bf16", "compile"],
                   choices=("autocast", "bf16", "compile"), help="the ViT-B LoRA section's modes")
    p.add_argument("--smoke", action="store_true", help="run every code path on tiny CPU tensors; no numbers")
    args = p.parse_args()
    SMOKE = args.smoke
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py measures CUDA kernels; no CUDA device here (CPU timings are not kernel "
                         "speeds — see benchmarks/memory_blocks.py for the CPU memory accounting)")
    device = "cpu" if SMOKE else "cuda"
    dtype = getattr(torch, args.dtype)
    numel = 4096 * 4 if SMOKE else args.numel
    result = {"device": "smoke (cpu)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "numel": numel, "dtype": str(dtype)}
    result["copy_GBps"] = copy_bandwidth(numel, dtype, device) / 1e9
    slug = re.sub(r"\W+", "_", result["device"]).strip("_").lower()
    path = args.out / f"gpu_kernels_{slug}.json"

    def save():  # after every section, so a later section's failure keeps the earlier numbers
        if not SMOKE:
            write_atomic(path, json.dumps(result, indent=1) + "\n")

    if "kernels" not in args.skip:
        result["correctness"] = correctness_rows(device, dtype)
        save()
        bps = result["copy_GBps"] * 1e9
        result["activations"] = activation_rows(numel, dtype, device, bps)
        save()
        result["norms"] = norm_rows(max(numel // 4096, 1), 4096, dtype, device, bps)
        save()
        result["glus"] = glu_rows(numel, dtype, device, bps)
        save()
    if "vit-lora" not in args.skip:
        result["vit_lora"] = vit_lora_rows(device, modes=args.vit_modes)
        save()
    if "training" not in args.skip:
        kw = {"d": 64, "blocks": 1, "batch": 2, "tokens": 16} if SMOKE else {}
        result["training_steps"] = training_step_rows(device, **kw)
        save()
    failed = [r for r in result.get("activations", []) + result.get("norms", []) + result.get("glus", [])
              + result.get("correctness", []) + result.get("training_steps", []) + result.get("vit_lora", [])
              if "error" in r]
    for r in failed:
        print(f"FAILED {r.get('op', r.get('model', ''))} / {r.get('impl', r.get('variant'))}: {r['error']}")
    if SMOKE:
        print(f"smoke run: every section ran ({len(failed)} implementation(s) failed); nothing written")
        return 1 if failed else 0
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
