"""patch_model on Hugging Face ViT and LLaMA (random init, no downloads): norms found by running the model."""

import copy

import pytest
import torch
from _helpers import skips_only_returned_norms

transformers = pytest.importorskip("transformers")  # in the [dev] extra, so CI always runs this file
from approxbp.kernels import MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2  # noqa: E402
from approxbp.kernels.ops.invact import InvActGELU, InvActSiLU  # noqa: E402
from approxbp.kernels.rewrite.patch import patch_model  # noqa: E402


def _vit():
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=10, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(cfg).double(), {
        "pixel_values": torch.randn(4, 3, 32, 32, dtype=torch.float64), "labels": torch.tensor([1, 2, 3, 4])}


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=100, attn_implementation="eager")
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 16))
    return transformers.LlamaForCausalLM(cfg).double(), {"input_ids": ids, "labels": ids}


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("build,norm_cls,acts", [(_vit, MSLayerNorm, (ReGELU2, InvActGELU)),
                                                 (_llama, MSRMSNorm, (ReSiLU2, InvActSiLU))])
@pytest.mark.parametrize("activation", ["relu-sum", "invact"])
def test_patch_hf_model_training_step(build, norm_cls, acts, activation):
    model, batch = build()
    model.train()
    merged = copy.deepcopy(model)  # the same merge with exact activations: the gradient reference
    example = {k: v for k, v in batch.items() if k != "labels"}
    ref_report = patch_model(merged, family=None, example_input=example, glu=False)
    report = patch_model(model, family=activation, example_input=example, glu=False)  # the drop-ins in a GLU
    assert report.norms == ref_report.norms and skips_only_returned_norms(report)
    norms = 5  # 2 blocks × 2 norms + the final one (Llama's is its last hidden state: its output shared); 2 MLPs
    assert len(report.norms) == norms and len(report.activations) == 2
    assert sum(isinstance(m, norm_cls) for m in model.modules()) == norms
    want = acts[0] if activation == "relu-sum" else acts[1]
    assert sum(isinstance(m, want) for m in model.modules()) == 2
    for m in (model, merged):
        for mod in m.modules():  # dropout off so both runs see the same function
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    with torch.no_grad():
        assert torch.allclose(model(**example).logits, merged(**example).logits, rtol=1e-9, atol=1e-9)
    g, g_ref = _grads(model, batch), _grads(merged, batch)
    cosine = float(torch.nn.functional.cosine_similarity(g, g_ref, dim=0))
    # measured (README): ReLU-sum k=2 0.868 (ViT), 0.989 (LLaMA); InvAct 1.000000. HF's init (std 0.02) keeps
    # the ViT's fc1 pre-activations within |x| < 1, where ReGELU2's 4-level derivative is coarsest
    min_cosine = {("relu-sum", "_vit"): 0.85, ("relu-sum", "_llama"): 0.98}.get((activation, build.__name__), 0.999999)
    print(f"{build.__name__} {activation}: gradient cosine {cosine:.6f}")
    assert cosine >= min_cosine, cosine
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = model(**batch).loss.item()
    opt.step()
    assert model(**batch).loss.item() < before  # the patched model trains


def test_unpatched_forward_is_preserved_by_norm_merging():
    model, batch = _vit()
    model.eval()
    ref = copy.deepcopy(model)
    example = {"pixel_values": batch["pixel_values"]}
    patch_model(model, family=None, example_input=example)
    with torch.no_grad():
        assert torch.allclose(model(**example).logits, ref(**example).logits, rtol=1e-12, atol=1e-12)


def test_hf_model_without_example_input_reports_why_norms_are_skipped():
    model, _ = _llama()
    report = patch_model(model, family="relu-sum")
    assert len(report.activations) == 2 and not report.norms
    assert "example_input" in report.skipped[0]
