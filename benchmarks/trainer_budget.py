"""What a budget covers in a real Trainer run: each row trains the tiny Llama of the tests (hidden 32, 2 layers,
vocabulary 64, fp32 AdamW, batch 2) on the CPU for a few steps, stock and with ``ApproxBPCallback(budget=…)``, and
counts every step's peak (``tests/support/_step_peaks.py``: the bytes of every storage alive, a dispatch-mode
counter that agrees with MemTracker byte for byte; under ``as_kernels()`` and ``as_a_gpu_runs_it()``, so the CPU
step allocates what the planned GPU step does). A row passes when every step of ours is within the budget, or the
callback refused before the first step, by name.

    python benchmarks/trainer_budget.py [--out benchmarks/results/trainer_budget.json] [--docs docs/training.md]

About 1 min on two cores. The table in docs/training.md is this script's output (``--docs``); the test
``tests/benchmarks/test_trainer_budget_docs.py`` checks the page shows the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from _step_peaks import LiveBytes, StepPeaks, held  # noqa: E402
from _tiny_llm import padded, tiny_data, tiny_llama, tiny_tokenizer, varied  # noqa: E402
from approxbp.approximations.files import write_atomic  # noqa: E402
from approxbp.kernels.ops.custom_ops import as_kernels  # noqa: E402

from approxbp.planner.attention import as_a_gpu_runs_it  # noqa: E402
from approxbp.trainer import ApproxBPCallback  # noqa: E402

BUDGET = 440_000  # under the stock step's 451 200 bytes
MARKERS = ("<!-- trainer-budget: start -->\n", "<!-- trainer-budget: end -->")


def _eager():
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    return model


class _PopsTheLabels(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


#: name → (model builder, Trainer class, TrainingArguments extras, budget, data, collator).
ROWS = {
    "plain": (tiny_llama, transformers.Trainer, {}, BUDGET, None, None),
    "gradient_accumulation_steps=4": (tiny_llama, transformers.Trainer, {"gradient_accumulation_steps": 4},
                                      BUDGET, None, None),
    "label_smoothing_factor=0.1": (tiny_llama, transformers.Trainer, {"label_smoothing_factor": 0.1}, BUDGET,
                                   None, None),
    "attn_implementation=eager": (_eager, transformers.Trainer, {}, BUDGET, None, None),
    "compute_loss without labels": (tiny_llama, _PopsTheLabels, {}, BUDGET, None, None),
    "8- then 24-token batches": (tiny_llama, transformers.Trainer, {"train_sampling_strategy": "sequential"},
                                 540_000, varied, padded),
}


def _train(build, trainer_class, extra, data, collate, callback, steps=4):
    torch.manual_seed(0)
    peaks = StepPeaks(callback)
    args = transformers.TrainingArguments(output_dir="/tmp/approxbp-trainer-budget", per_device_train_batch_size=2,
                                          max_steps=steps, learning_rate=3e-3, report_to=[], save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, **extra)
    trainer = trainer_class(model=build(), args=args, train_dataset=(data or tiny_data)(), data_collator=collate,
                            callbacks=[c for c in (callback, peaks) if c])
    with as_kernels(), as_a_gpu_runs_it():
        trainer.train()
    return peaks.peaks


def measure_row(name: str) -> dict:
    build, trainer_class, extra, budget, data, collate = ROWS[name]
    stock = _train(build, trainer_class, extra, data, collate, None)
    callback = ApproxBPCallback(budget=budget)
    ours = _train(build, trainer_class, extra, data, collate, callback)
    plan = callback.plan
    return {"name": name, "budget": budget, "stock": stock, "ours": ours, "planned": plan.after.peak,
            "planned_shape": [plan.batch, plan.seq], "chunked_loss": bool(plan.chunked_loss),
            "within": max(ours) <= budget}


class _RefPeaks(StepPeaks):
    """StepPeaks with the reference model's weights counted (alive through every step)."""

    def __init__(self, ref):
        super().__init__()
        self.ref = ref

    def _start(self):
        self._mode = LiveBytes(held(self._model, self._optimizer) + list(self.ref.parameters()))
        self._mode.__enter__()


def measure_dpo() -> dict:
    """TRL's DPOTrainer, stock: its steps' peaks (the reference model counted), beside the callback's refusal and
    what the planner plans for the same first batch."""
    import datasets
    import trl

    from approxbp.planner.training import Setup
    from approxbp.trainer import plan_for

    words = [" ".join(f"t{(i + j) % 64}" for j in range(8)) for i in range(16)]
    rows = [{"prompt": w, "chosen": words[(i + 1) % 16], "rejected": words[(i + 3) % 16]} for i, w in enumerate(words)]

    def trainer(callbacks):
        torch.manual_seed(0)
        model, ref = tiny_llama(), tiny_llama()
        model.config.pad_token_id = ref.config.pad_token_id = 0
        args = trl.DPOConfig(output_dir="/tmp/approxbp-trainer-budget", per_device_train_batch_size=2, max_steps=3,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
        return trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(rows),
                              processing_class=tiny_tokenizer(), callbacks=callbacks), ref

    run, ref = trainer([])
    peaks, shapes = _RefPeaks(ref), []
    run.add_callback(peaks)
    run.model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)) if m.training
                                        else None, with_kwargs=True)
    with as_kernels(), as_a_gpu_runs_it():
        run.train()
    refused, _ = trainer([ApproxBPCallback(budget=BUDGET)])
    try:
        refused.train()
        reason = None
    except ValueError as err:
        reason = str(err)
    example = {"input_ids": torch.zeros(shapes[0], dtype=torch.long)}
    plan = plan_for(tiny_llama(), example, 10 * max(peaks.peaks), gpu=None, setup=Setup(weights="fp32",
                    autocast="off", optimizer="adamw"), longest=shapes[0][1])
    return {"name": "TRL DPOTrainer (fused LM head, reference model)", "budget": BUDGET, "stock": peaks.peaks,
            "ours": None, "planned": plan.after.peak, "planned_shape": list(shapes[0]), "refused": reason,
            "within": reason is not None}


def markdown(rows: list[dict]) -> str:
    """The docs table: per row the budget, stock's and ours' largest step peak, the plan's traced peak."""
    out = ["| run | budget | stock's largest step | ours, every step (largest) | planned (shape, chunked loss) | "
           "holds |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        ours = "refused at on_train_begin" if r.get("refused") else f"{max(r['ours']):,}"
        chunked = "" if r.get("refused") else (", chunked loss" if r["chunked_loss"] else ", no chunked loss")
        shape = " × ".join(map(str, r["planned_shape"]))
        out.append(f"| {r['name']} | {r['budget']:,} | {max(r['stock']):,} | {ours} | {r['planned']:,} "
                   f"({shape}{chunked}) | {'yes' if r['within'] else '**no**'} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trainer_budget.json")
    ap.add_argument("--docs", type=Path, default=None, help="write the table between the markers of this page")
    args = ap.parse_args(argv)
    rows = [measure_row(name) for name in ROWS] + [measure_dpo()]
    versions = {m.__name__: m.__version__ for m in (torch, transformers)}
    write_atomic(args.out, json.dumps({"machine": platform.processor() or platform.machine(), "versions": versions,
                                       "rows": rows}, indent=1) + "\n")
    table = markdown(rows)
    print(table)
    if args.docs:
        page = args.docs.read_text()
        head, rest = page.split(MARKERS[0])
        write_atomic(args.docs, head + MARKERS[0] + table + MARKERS[1] + rest.split(MARKERS[1], 1)[1])
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
