"""The planner's step-time model against a GPU (issue 46 item 2): each set-up's training step (forward under the
set-up's autocast, then backward; no optimizer, as ``~.plan_moves.time_step`` models it) timed on the CUDA
device, beside the roofline's prediction for that GPU on fake tensors. CUDA only for the measured column;
``--smoke`` runs every code path on a tiny model on the CPU with the H100's constants, prints no time it took and
writes nothing (the tests use it).

    python benchmarks/gpu_step_time.py [--out benchmarks/results] [--steps 20]

Set-ups (each on the same model): exact; the exact fused GLU + MS-norms; those + every block recomputed; + every
block offloaded; + the chunked loss. Writes gpu_step_time_<device>.json: per set-up the measured median and min
(ms), the modelled ms and their ratio. The ratio is the calibration: the roofline has no launch or host time, so it
is a lower bound; a ratio that differs between set-ups says which moves the model mis-charges.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

MODEL = "llama:hidden_size=2048,num_hidden_layers=8,intermediate_size=5632,num_attention_heads=16,vocab_size=32000"
SMOKE = "llama:hidden_size=64,num_hidden_layers=2,intermediate_size=128,num_attention_heads=4,vocab_size=512"
#: (name, {block: move} rule, chunked loss, assignment of the fused GLU + MS-norms)
SETUPS = (("exact", None, False, False), ("glu+ms-norm", None, False, True),
          ("glu+ms-norm, every block recomputed", "recompute", False, True),
          ("glu+ms-norm, every block offloaded", "offload", False, True),
          ("glu+ms-norm, loss chunked", None, True, True))


def _model(text: str, setup, batch: int, seq: int, fused: bool, move: str | None, chunked: bool, device: str):
    """(model, inputs) of the set-up, built on ``device`` (under the planner's fake mode when it is "fake")."""
    from approxbp.planner.models import model_spec
    from approxbp.planner.moves import apply_moves
    from approxbp.planner.plan_step import activation_layers, apply
    from approxbp.planner.step_memory import first_block, prepare
    from approxbp.planner.step_time import block_paths
    from approxbp.planner.training import weights_for

    torch.manual_seed(0)
    with weights_for(setup):
        model, make_inputs = model_spec(text)()
        model = prepare(model, setup)
    if device == "cuda":
        model = model.cuda()
    inputs = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in make_inputs(batch, seq).items()}
    assignment = {p: "glu" for p in activation_layers(model)} if fused else {}
    if assignment or fused or chunked:
        apply(model, assignment, fused, inputs, chunked_loss=chunked)
    if move:
        apply_moves(model, {b: move for b in block_paths(model, first_block(model))})
    return model, inputs


def predicted_ms(text: str, setup, batch: int, seq: int, gpu, row) -> float:
    """What the planner charges the set-up's step for ``gpu``: the roofline on fake tensors; an offloaded block adds
    its host copies not hidden behind its compute, max(0, 2·S_b/L − F_b − B_b) (``~.moves.BlockCost``), from
    the planner's measured S_b and the roofline's F_b, B_b of the same step without the move."""
    from approxbp.planner.models import no_init
    from approxbp.planner.plan_moves import block_costs, time_step
    from approxbp.planner.plan_step import _fake_like_real, activation_layers, stepper
    from approxbp.planner.request import Request

    offload = row[1] == "offload"
    with _fake_like_real(), no_init():
        model, inputs = _model(text, setup, batch, seq, row[3], None if offload else row[1], row[2], "fake")
        time = time_step(model, inputs, setup, gpu)
        layers = activation_layers(model)
    extra = 0.0
    if offload:
        step = stepper(Request(model=text, setup=setup), whole=True)(batch, seq, {p: "glu" for p in layers}, row[3])
        extra = sum(c.seconds("offload", gpu.host_link) for c in block_costs(step, time, setup.dtype.itemsize).values())
    return 1e3 * (time.total + extra)


def measured_ms(text: str, setup, batch: int, seq: int, row, steps: int, device: str) -> tuple[float, float]:
    """(median, min) ms of ``steps`` timed steps after 3 untimed ones (CUDA events; the CPU's clock for --smoke)."""
    import time

    from approxbp.planner.step_memory import _loss_of

    model, inputs = _model(text, setup, batch, seq, row[3], row[1], row[2], device)
    times = []
    for i in range(steps + 3):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=setup.autocast != "off"):
            loss = _loss_of(model(**inputs))
        loss.backward()
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) if device == "cuda" else 1e3 * (time.perf_counter() - t0))
        model.zero_grad(set_to_none=True)
    times.sort()
    return times[len(times) // 2], times[0]


def gpu_of(name: str):
    """The planner's constants for the device's name (H100, H200, A100, RTX 4090), or a refusal naming them."""
    from approxbp.planner.gpus import GPUS

    for key, pattern in (("h200", "H200"), ("h100", "H100"), ("a100", "A100"), ("rtx4090", "4090")):
        if pattern in name:
            return GPUS[key]
    raise SystemExit(f"gpu_step_time: no planner constants for {name!r} (planner/gpus.py has {', '.join(GPUS)})")


def main() -> int:
    from approxbp.planner.training import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="every code path on a tiny model on the CPU, no file")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_step_time: no CUDA device (--smoke runs the code paths on the CPU)", file=sys.stderr)
        return 2
    text, batch, seq = (SMOKE, 2, 64) if args.smoke else (MODEL, args.batch, args.seq)
    name = "smoke (H100 constants)" if args.smoke else torch.cuda.get_device_name()
    gpu = gpu_of("H100" if args.smoke else name)
    setup = PRESETS["lora"]
    rows = []
    for row in SETUPS:
        modelled = predicted_ms(text, setup, batch, seq, gpu, row)
        got = {"setup": row[0], "modelled_ms": modelled}
        median, best = measured_ms(text, setup, batch, seq, row, 2 if args.smoke else args.steps,
                                   "cpu" if args.smoke else "cuda")
        if not args.smoke:  # a CPU time is no GPU time: the smoke run only exercises the code
            got.update(measured_median_ms=median, measured_min_ms=best, ratio=median / modelled)
        rows.append(got)
        print(json.dumps(got), flush=True)
    if not args.smoke:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"gpu_step_time_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json"
        path.write_text(json.dumps({"device": name, "torch": torch.__version__, "model": text, "batch": batch,
                                    "seq": seq, "setup": "lora (bf16 weights, LoRA q,v)", "gpu_constants": gpu.name,
                                    "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
