"""The planner counts attention as a GPU's fused SDPA keeps it: with dropout, q, k, v, the output,
one fp32 log-sum-exp per query row and the RNG state, never the n × n probabilities the CPU's math path keeps."""

import pytest
import torch
import torch.nn.functional as F
from approxbp.kernels.ops.saved import charged

from approxbp.planner import plan_step as PS
from approxbp.planner.attention import RNG_STATE_BYTES, gpu_attention
from approxbp.planner.request import Request

transformers = pytest.importorskip("transformers")
BERT = "bert:hidden=64,layers=2,heads=4,intermediate=128,vocab=128,max_position_embeddings=512"


def _bert(attention_dropout: float):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=512,
                                  attention_probs_dropout_prob=attention_dropout)
    return transformers.BertForMaskedLM(cfg).train()


def _saved(model, ids, gpu: bool) -> dict:
    saved = {}
    with (gpu_attention() if gpu else torch.enable_grad()), charged(saved, list(model.parameters()), model):
        model(input_ids=ids)
    return saved


def test_attention_with_dropout_keeps_what_the_fused_kernel_keeps():
    b, n, heads, d = 2, 256, 4, 16
    ids = torch.randint(3, 128, (b, n))
    cpu, gpu = _saved(_bert(0.1), ids, False), _saved(_bert(0.1), ids, True)
    fused_without_dropout = _saved(_bert(0.0), ids, False)  # the CPU's fused kernel: q, k, v, out, lse
    layer = "bert.encoder.layer.0.attention.self"
    expected = 4 * b * heads * n * d * 4 + b * heads * n * 4 + RNG_STATE_BYTES  # fp32 q, k, v, out; lse; seed, offset
    assert gpu[layer] == expected < cpu[layer] / 10  # the math path keeps the n × n probabilities and their mask
    assert {k: v for k, v in gpu.items() if k.endswith("attention.self")} == {
        k: v + RNG_STATE_BYTES for k, v in fused_without_dropout.items() if k.endswith("attention.self")}
    assert sum(gpu.values()) == sum(fused_without_dropout.values()) + 2 * RNG_STATE_BYTES  # nothing else moves


def test_the_plan_counts_it_on_fake_and_real_tensors_alike():
    fake, real = PS.stepper(Request(model=BERT, setup="bf16"))(2, 256), PS.stepper(Request(model=BERT, setup="bf16",
                                                                                           fake=False))(2, 256)
    assert fake.saved == real.saved
    layer = fake.saved["bert.encoder.layer.0.attention.self"]
    assert layer == 4 * 2 * 4 * 256 * 16 * 2 + 2 * 4 * 256 * 4 + RNG_STATE_BYTES  # bf16 q, k, v, out; fp32 lse


def test_its_gradients_are_attentions():
    """A memory model, but a correct step: at a vanishing dropout rate the gradients are those of plain attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with gpu_attention():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=1e-300)
    assert out.grad_fn.name().endswith("_FusedAttentionWithDropoutBackward")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).square().sum(), (q, k, v))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
