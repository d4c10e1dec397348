"""A patched model trains as the stock model does, apart from the approximate activation gradient (issue: never
silently wrong): tiny Hugging Face Llama, ViT and GPT-2 in fp64, 30 AdamW steps from the same initial weights, and
their state dicts load into the stock classes and back."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _helpers import skips_only_returned_norms  # noqa: E402
from approxbp.kernels import patch_model  # noqa: E402

STEPS = 30


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=61,
                                   max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(1)
    return model, {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (4,),
                                                                                                  generator=g)}


def _pretrained(build):
    torch.manual_seed(0)
    model, batch = build()
    model = model.double()
    with torch.no_grad():  # norms away from their init, as in a checkpoint
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name):
                p.add_(0.3 * torch.randn_like(p))
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    return model, batch


def _train(model, batch, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("build", [_llama, _vit, _gpt2], ids=["llama", "vit", "gpt2"])
@pytest.mark.parametrize("activation, tolerance", [("invact", 1e-4), ("relu-sum", 0.03)])
def test_patched_model_trains_like_the_stock_model(build, activation, tolerance):
    stock, batch = _pretrained(build)
    ours = copy.deepcopy(stock)
    example = {k: v for k, v in batch.items() if k != "labels"}
    report = patch_model(ours, family=activation, example_input=example)
    assert report.norms and (report.activations or report.glus) and skips_only_returned_norms(report), report
    assert ours.state_dict().keys() == stock.state_dict().keys()  # the stock layout: nothing merged
    ref, got = _train(stock, batch), _train(ours, batch)
    rel = ((got - ref).abs() / ref.abs()).max().item()
    print(f"{build.__name__} {activation}: loss {ref[0]:.4f} → {ref[-1]:.4f}, ours → {got[-1]:.4f}, "
          f"max relative difference {rel:.2e}")
    assert ref[-1] < 0.9 * ref[0] and rel <= tolerance


@pytest.mark.parametrize("build", [_llama, _vit, _gpt2], ids=["llama", "vit", "gpt2"])
def test_state_dicts_round_trip_with_the_stock_class(build):
    stock, batch = _pretrained(build)
    ours = copy.deepcopy(stock)
    example = {k: v for k, v in batch.items() if k != "labels"}
    patch_model(ours, family="invact", example_input=example)
    _train(ours, batch, steps=3)  # trained while patched
    fresh, _ = _pretrained(build)
    fresh.load_state_dict(ours.state_dict(), strict=True)  # patched → stock, no unpatch needed
    ours.eval(), fresh.eval()
    # HF's LlamaRMSNorm computes in fp32 even for fp64 input (the MS-norm in fp64): 4e-8 apart
    with torch.no_grad():
        assert torch.allclose(fresh(**example).logits, ours(**example).logits, rtol=1e-6, atol=1e-6)
    other, _ = _pretrained(build)
    _train(other, batch, steps=2)
    ours.load_state_dict(other.state_dict(), strict=True)  # stock → patched
    other.eval()
    with torch.no_grad():
        assert torch.allclose(ours(**example).logits, other(**example).logits, rtol=1e-6, atol=1e-6)


def test_a_norm_whose_output_is_returned_returns_the_stock_value():
    """With output_hidden_states the last hidden state is the final norm's output: an MS-norm returning z changed it
    (by 1.8), so it becomes a shared-output MS-norm (y = α⊙z + β returned, z for lm_head) and every returned tensor
    stays as it was."""
    model, batch = _pretrained(_llama)
    model.config.output_hidden_states = True
    example = {"input_ids": batch["input_ids"]}
    model.eval()
    with torch.no_grad():
        before = model(**example)
    report = patch_model(model, family="invact", example_input=example)
    assert any("SharedOutput" in s and "returned as a model output" in s for s in report.norms), report
    with torch.no_grad():
        after = model(**example)
    for a, b in zip(after.hidden_states, before.hidden_states, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_bias_free_consumer_keeps_its_trained_function_through_unpatch():
    """Falcon-style: a LayerNorm with bias feeding a Linear without one. Merging created a bias that unpatch then
    dropped after training (0.07 off); the trainable path creates none."""
    from approxbp.kernels import unpatch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4, bias=False)).double()
    with torch.no_grad():
        m[0].bias.normal_()
    x = torch.randn(16, 8, dtype=torch.float64)
    patch_model(m, family=None)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(10):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    trained = m(x).detach()
    unpatch(m)
    assert type(m[1]) is torch.nn.Linear and m[1].bias is None
    assert torch.allclose(m(x), trained, rtol=1e-12, atol=1e-12)
