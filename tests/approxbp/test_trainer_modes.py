"""The Trainer callback with gradient checkpointing on, on a peft LoRA model, and with torch_compile=True: each
trains 20 steps to stock's losses (relative 1e-6), patched on its first batch with the chunked loss applied. What
each merges is what saves there: with checkpointing the final norm only (a checkpointed block keeps its input
alone), with peft the two norms whose readers are LoRA-adapted Linears and both gated MLPs, under torch_compile all
five norms and both gated MLPs (the patch runs eagerly although the first forward is being compiled: traced by
dynamo, its measurement said the norms would save more and nothing was merged)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_llm import tiny_data, tiny_llama  # noqa: E402

from approxbp.trainer import ApproxBPCallback  # noqa: E402

_data, _llama = tiny_data, tiny_llama


def _lora():
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _train(build, out_dir, callback=None, **extra):
    torch.manual_seed(0)
    model = build()
    args = transformers.TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=20,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, data_seed=0, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                   callbacks=[callback] if callback else None)
    trainer.train()
    return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("build, extra, merged", [
    (_llama, {"gradient_checkpointing": True}, (1, 0)),
    (_lora, {}, (2, 2)),
    (_llama, {"torch_compile": True, "torch_compile_backend": "aot_eager"}, (5, 2)),
], ids=["gradient-checkpointing", "peft-lora", "torch-compile"])
@pytest.mark.slow
def test_the_callback_trains_as_stock_in_each_mode(build, extra, merged, tmp_path):
    _, stock = _train(build, tmp_path / "stock", **extra)
    callback = ApproxBPCallback(family="invact", chunked_loss=True)
    model, ours = _train(build, tmp_path / "ours", callback, **extra)
    assert callback.report is not None, "the callback did not patch"
    assert (len(callback.report.norms), len(callback.report.glus)) == merged, callback.report
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    assert "_approxbp_chunked_loss" in base.__dict__  # the move was applied
    assert len(ours) == len(stock) == 20
    for a, b in zip(stock, ours):
        assert b == pytest.approx(a, rel=1e-6, abs=0), (stock, ours)
