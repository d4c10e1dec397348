"""A patched model with moves (recompute, offload, the chunked loss; the MoE experts' own forward) copies as a stock
one does: a deep copy's forward and backward run its own parameters, and ``torch.save`` stores it whole (its forwards
are objects holding their module, not closures: ``kernels/rewrite/bound_forward.py``)."""

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_llm import VOCAB, tiny_data, tiny_llama  # noqa: E402
from approxbp.kernels.rewrite.patch import patch_model  # noqa: E402

from approxbp.planner.moves import apply_moves  # noqa: E402


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32))


def _moved(build):
    torch.manual_seed(0)
    model = build().train()
    ids = torch.stack([r["input_ids"] for r in tiny_data()[:2]])
    report = patch_model(model, family="invact", example_input={"input_ids": ids})
    apply_moves(model, {"model.layers.0": "recompute", "model.layers.1": "offload"}, chunked_loss=True)
    return model, {"input_ids": ids, "labels": ids}, report


@pytest.mark.parametrize("build", [tiny_llama, _qwen3_moe], ids=["llama", "qwen3_moe"])
def test_a_deep_copy_runs_its_own_parameters(build):
    model, batch, report = _moved(build)
    assert report.glus or report.norms, report
    twin = copy.deepcopy(model)
    twin(**batch).loss.backward()
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        before = model(input_ids=batch["input_ids"]).logits
        for p in twin.parameters():
            p.mul_(0.5)
        assert torch.equal(model(input_ids=batch["input_ids"]).logits, before)
        assert not torch.equal(twin(input_ids=batch["input_ids"]).logits, before)


@pytest.mark.parametrize("build", [tiny_llama, _qwen3_moe], ids=["llama", "qwen3_moe"])
def test_torch_save_stores_a_moved_model_whole(build):
    model, batch, _ = _moved(build)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ours, theirs = model(**batch), loaded(**batch)
    assert "logits" not in ours and "logits" not in theirs  # the chunked loss came along
    torch.testing.assert_close(theirs.loss, ours.loss, rtol=0, atol=0)
    ours.loss.backward()
    theirs.loss.backward()
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
