"""Norms are found by what they compute (rewrite/norm_forms.py): a float64 probe proves the LayerNorm/RMSNorm form,
α = w or 1 + w, with or without bias or weight, whatever the class is called; anything else is named with the
reason. The rewrite then trains and merges exactly as the stock norm does."""

import copy

import pytest
import torch
from approxbp.kernels import patch_model, unpatch
from approxbp.kernels.rewrite.norm_forms import NormForm, norm_form
from torch import nn

transformers = pytest.importorskip("transformers")


class ScaleFreeRMS(nn.Module):
    """A user's RMSNorm under a name no list knows, eps inside the root as usual."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class MaxNorm(nn.Module):
    """Called a norm, computes no LayerNorm/RMSNorm form."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x / x.abs().amax(-1, keepdim=True)


def _hf(module_path, cls, *args):
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{module_path}"), cls)(*args)


@pytest.mark.parametrize("make, center, offset", [
    (lambda: nn.LayerNorm(8), True, 0.0),
    (lambda: nn.LayerNorm(8, bias=False), True, 0.0),
    (lambda: nn.RMSNorm(8), False, 0.0),
    (lambda: _hf("llama.modeling_llama", "LlamaRMSNorm", 8), False, 0.0),
    (lambda: _hf("qwen3.modeling_qwen3", "Qwen3RMSNorm", 8), False, 0.0),
    (lambda: _hf("gemma.modeling_gemma", "GemmaRMSNorm", 8), False, 1.0),
    (lambda: _hf("t5.modeling_t5", "T5LayerNorm", 8), False, 0.0),
    (lambda: _hf("nemotron.modeling_nemotron", "NemotronLayerNorm1P", 8), True, 1.0),
    (lambda: _hf("olmo.modeling_olmo", "OlmoLayerNorm", 8), True, 0.0),
    (lambda: _hf("cohere.modeling_cohere", "CohereLayerNorm", 8), True, 0.0),
    (lambda: ScaleFreeRMS(8), False, 0.0),
], ids=["LayerNorm", "LayerNorm-nobias", "RMSNorm", "Llama", "Qwen3", "Gemma(1+w)", "T5", "Nemotron(1P)",
        "OLMo(no weight)", "Cohere", "user-class"])
def test_the_probe_proves_each_form(make, center, offset):
    form = norm_form(make())
    assert isinstance(form, NormForm), form
    assert (form.dim, form.center, form.offset) == (8, center, offset)


@pytest.mark.parametrize("module, says", [(MaxNorm(8), "computes none of the norm forms"),
                                          (nn.LayerNorm((4, 8)), "not the last dimension alone"),
                                          (nn.GroupNorm(2, 8), "could not be probed")])
def test_anything_else_is_named_with_the_reason(module, says):
    assert says in norm_form(module)
    model = nn.Sequential(module, nn.Linear(8, 4)) if not isinstance(module, nn.LayerNorm) else None
    if model is not None:
        report = patch_model(model, family=None)
        assert not report.norms and any(says in s for s in report.skipped), report


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("make", [lambda: _hf("gemma.modeling_gemma", "GemmaRMSNorm", 8),
                                  lambda: _hf("nemotron.modeling_nemotron", "NemotronLayerNorm1P", 8),
                                  lambda: ScaleFreeRMS(8)], ids=["Gemma", "Nemotron", "user-class"])
def test_an_offset_or_unlisted_norm_is_rewritten_exactly(make, frozen):
    """Gemma's α = 1 + w was patched as α = w by class name (or not at all); Nemotron's LayerNorm1P refused the
    whole patch. Now rewritten; forward, gradients (trainable) and unpatch match the stock model."""
    torch.manual_seed(0)
    stock = nn.Sequential(make(), nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        for p in stock[0].parameters():
            p.add_(0.5 * torch.randn_like(p))
    stock.requires_grad_(not frozen)
    model = copy.deepcopy(stock)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    report = patch_model(model, family=None, example_input=x)
    assert len(report.norms) == 1 and "returns y by the stock forward" in report.norms[0], report
    tol = 1e-6 if "Gemma" in type(stock[0]).__name__ else 1e-12  # Gemma's norm computes in float32 inside
    torch.testing.assert_close(model(x), stock(x), rtol=tol, atol=tol)
    if not frozen:
        model(x).square().sum().backward()
        stock(x).square().sum().backward()
        for (n, a), b in zip(model.named_parameters(), stock.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=tol, msg=n)
    unpatch(model)
    assert type(model[0]) is type(stock[0])
    torch.testing.assert_close(model(x), stock(x), rtol=tol, atol=tol)


def test_a_gemma_model_gets_its_norms():
    """Gemma (1 + w RMSNorms, no class on any list) now has its block norms rewritten and trains exactly."""
    cfg = transformers.AutoConfig.for_model("gemma", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=50)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg).double()
    with torch.no_grad():
        for n, p in stock.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    model = copy.deepcopy(stock)
    ids = torch.randint(0, 50, (2, 8))
    report = patch_model(model, family=None, example_input={"input_ids": ids})
    assert len(report.norms) == 5, report  # 2 per layer and the final one (the last hidden state: returned as stock)
    for m in (stock, model):
        m(input_ids=ids, labels=ids).loss.backward()
    for (n, a), b in zip(model.named_parameters(), stock.parameters()):  # Gemma's norms round to float32 inside
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=n)


class GatedRMS(ScaleFreeRMS):
    """A gated norm, norm(x, gate) = RMSNorm(x)·silu(gate) (Qwen3-Next, GraniteMoE-Hybrid): with gate=None it is a
    plain RMSNorm, which is what a probe of x alone would see."""

    def forward(self, x, gate=None):
        y = super().forward(x)
        return y if gate is None else y * nn.functional.silu(gate)


class GatedBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.gate, self.out = GatedRMS(d), nn.Linear(d, d), nn.Linear(d, d)
        self.pre, self.up = ScaleFreeRMS(d), nn.Linear(d, d)

    def forward(self, x):
        h = self.up(self.pre(x))
        return self.out(self.norm(h, self.gate(x)))


def test_a_gated_norm_is_skipped_with_the_reason_and_the_rest_patched():
    """It used to be made an MS-norm (the probe passes x alone) and the model's call with the gate crashed the
    whole patch: now it is named, left as it is, and the plain norm beside it is rewritten."""
    torch.manual_seed(0)
    stock = GatedBlock().double()
    model = copy.deepcopy(stock)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    report = patch_model(model, family=None, example_input=x)
    assert isinstance(norm_form(stock.norm), str) and "takes gate beside the input" in norm_form(stock.norm)
    assert any(s.startswith("norm (GatedRMS): its forward takes gate") for s in report.skipped), report.skipped
    assert [n.split(" ")[0] for n in report.norms] == ["pre"], report.norms
    torch.testing.assert_close(model(x), stock(x), rtol=1e-12, atol=1e-12)
