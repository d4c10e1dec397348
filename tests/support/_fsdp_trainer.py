"""Run by ``torch.distributed.run`` (two gloo processes): a tiny Llama trained 10 steps by Hugging Face ``Trainer``
with accelerate's FSDP2 (``fsdp_config={"version": 2}``), with or without the ApproxBPCallback; rank 0 writes the
losses, the callback's report and whether the moves were applied, and saves the model.

    python -m torch.distributed.run --nproc_per_node 2 _fsdp_trainer.py OUT stock ours

Each name is one run, one after the other in the same two processes (one start of torch, transformers and the
process group for both: about half of a run's time on two cores).
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from _tiny_llm import tiny_data, tiny_llama

from approxbp.trainer import ApproxBPCallback


def main(out: str, which: str) -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=f"{out}/{which}", per_device_train_batch_size=1, max_steps=10, learning_rate=3e-3, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, data_seed=0, save_strategy="no", ddp_backend="gloo",
        fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    callback = (ApproxBPCallback(family="invact", moves={"model.layers.0": "recompute"}, chunked_loss=True)
                if which == "ours" else None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=tiny_data(),
                                   callbacks=[callback] if callback else None)
    trainer.train()
    trainer.save_model(f"{out}/{which}/final")
    if int(os.environ.get("RANK", "0")) == 0:
        inner = trainer.model_wrapped if hasattr(trainer, "model_wrapped") else model
        moved = any("_approxbp_chunked_loss" in m.__dict__ for m in (model, inner))
        Path(f"{out}/{which}.json").write_text(json.dumps({
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "report": str(callback.report) if callback else None,
            "norms": len(callback.report.norms) if callback else 0, "chunked": moved}))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(sys.argv[1], name)
