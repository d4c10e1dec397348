"""Fine-tuning a patched model with the Hugging Face Trainer: tiny random-init Llama and ViT on
small synthetic tasks, bf16 autocast where the CPU supports it. Patched and exact losses both fall, and after
``unpatch`` the checkpoint loads into the stock class with the trained model's outputs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")  # in the [dev] extra, so CI always runs this file
from approxbp.kernels.ops.norms import MSLayerNorm  # noqa: E402
from approxbp.kernels.rewrite.patch import patch_model, unpatch  # noqa: E402
from transformers.utils.import_utils import is_torch_bf16_available_on_device  # noqa: E402

BF16 = is_torch_bf16_available_on_device("cpu")


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=64, attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, 64, (64, 1), generator=g) + torch.arange(32)) % 64  # next token = token + 1 (mod 64)
    return (transformers.LlamaForCausalLM, cfg, [{"input_ids": r, "labels": r} for r in ids],
            {"input_ids": ids[:4]})


def _vit():
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=16, patch_size=8, num_labels=4, attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (64,), generator=g)
    images = 0.3 * torch.randn(64, 3, 16, 16, generator=g)
    for i, label in enumerate(labels):  # the label is the bright quadrant
        r, c = divmod(int(label), 2)
        images[i, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8] += 1.0
    return (transformers.ViTForImageClassification, cfg,
            [{"pixel_values": im, "labels": lab} for im, lab in zip(images, labels)], {"pixel_values": images[:4]})


def _train(cls, cfg, data, example, activation, out_dir):
    torch.manual_seed(0)
    model = cls(cfg)
    if activation is not None:
        report = patch_model(model, family=activation, example_input=example)
        norms = 5  # Llama's final norm, its last hidden state, too: a shared-output MS-norm
        assert len(report.norms) == norms and len(report.activations) + len(report.glus) == 2, report
    args = transformers.TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=8, num_train_epochs=4,
                                          learning_rate=3e-3, logging_steps=4, report_to=[], save_strategy="no",
                                          use_cpu=True, bf16=BF16, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.accelerator.unwrap_model(model, keep_fp32_wrapper=False), losses


@pytest.mark.parametrize("build", [_llama, _vit])
@pytest.mark.slow
def test_trainer_fine_tunes_patched_and_exact_and_the_checkpoint_reloads(build, tmp_path):
    cls, cfg, data, example = build()
    curves = {}
    for activation in (None, "relu-sum", "invact"):
        model, losses = _train(cls, cfg, data, example, activation, tmp_path / "run")
        curves[activation] = losses
        assert losses[-1] < 0.7 * losses[0], (activation, losses)
        if activation is None:
            continue
        assert any(isinstance(m, MSLayerNorm) for m in model.modules())
        model.eval()
        with torch.no_grad():
            want = model(**example).logits
        unpatch(model).save_pretrained(tmp_path / activation)
        stock = cls.from_pretrained(tmp_path / activation, attn_implementation="eager").eval()
        assert not any(isinstance(m, MSLayerNorm) for m in stock.modules())
        with torch.no_grad():
            assert torch.allclose(stock(**example).logits, want, rtol=1e-5, atol=1e-5)
    print(build.__name__, "bf16" if BF16 else "fp32", {k: [round(v, 3) for v in c] for k, c in curves.items()})
    # ReLU-sum / InvAct follow the exact curve closely on these easy tasks
    assert abs(curves["relu-sum"][-1] - curves[None][-1]) < 0.5 * curves[None][0]
