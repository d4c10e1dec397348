"""patch_model with peft LoRA in both orders: norms merge into the frozen base Linear only,
the adapters keep their own weights and train, and the saved bytes per block match the memory table's
frozen-linear column."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")  # in the [dev] extra, so CI always runs this file
transformers = pytest.importorskip("transformers")
from approxbp.kernels.ops.norms import MSLayerNorm  # noqa: E402
from approxbp.kernels.ops.saved import saved_bytes  # noqa: E402
from approxbp.kernels.rewrite.norm_merge import NormInputLinear  # noqa: E402
from approxbp.kernels.rewrite.patch import patch_model, patched_state_dict  # noqa: E402

from approxbp.blocks import ViTBlock, saved_per_token_per_d  # noqa: E402
from approxbp.planner import models as MD  # noqa: E402
from approxbp.planner import step_memory as SM  # noqa: E402
from approxbp.planner import training as SU  # noqa: E402

LORA = dict(r=4, target_modules=["q_proj", "v_proj"])


def _vit():
    """A tiny HF ViT in fp64 whose LayerNorms have random α, β (as a pretrained checkpoint's do)."""
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=10, attn_implementation="eager",
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    return model, {"pixel_values": torch.randn(4, 3, 32, 32, dtype=torch.float64)}, torch.tensor([1, 2, 3, 4])


def _lora(model):
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    with torch.no_grad():  # B = 0 at peft's init would hide what the adapters read
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def _grads(model, x, labels):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(**x).logits, labels).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_lora_then_patch_keeps_the_base_linear_and_adapter_gradients_exact():
    """The norms return the stock value; the base Linears and the adapters' lora_A save the shared z."""
    model, x, labels = _vit()
    model = _lora(model)
    ref = copy.deepcopy(model)
    report = patch_model(model, family=None, example_input=x)
    assert len(report.norms) == 5 and not report.skipped and report.max_output_difference < 1e-12
    assert "lora_A" in report.norms[0] and "base_layer" in report.norms[0]
    wrapped = [n for n, m in model.named_modules() if isinstance(m, NormInputLinear) and "lora_A" in n]
    assert len(wrapped) == 4  # q and v of 2 layers
    base = model.base_model.model.vit.layers[0].attention.q_proj.base_layer
    assert not base.weight.requires_grad and base.weight.shape == (64, 64)
    g, g_ref = _grads(model, x, labels), _grads(ref, x, labels)
    assert sorted(g) == sorted(g_ref) and all("lora_" in n or "classifier" in n for n in g)
    for name in g:  # the adapters see α⊙z + β exactly as before: same parameters, same gradients
        assert torch.allclose(g[name], g_ref[name], rtol=1e-9, atol=1e-12), name
    # the adapter state dict (what peft saves) is unchanged: same keys, same tensors
    lora_keys = [k for k in model.state_dict() if "lora_" in k]
    assert lora_keys == [k for k in ref.state_dict() if "lora_" in k]


def test_lora_then_patch_state_dict_loads_into_the_stock_lora_model():
    model, x, _ = _vit()
    model = _lora(model)
    stock = copy.deepcopy(model)
    patch_model(model, family="relu-sum", example_input=x)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.add_(torch.randn_like(p))  # as if trained
    stock.load_state_dict(patched_state_dict(model), strict=True)
    model.eval(), stock.eval()
    with torch.no_grad():
        assert torch.allclose(model(**x).logits, stock(**x).logits, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("order", ["lora-then-patch", "patch-then-lora"])
def test_adapters_train_and_base_weights_stay_frozen(order):
    model, x, labels = _vit()
    if order == "patch-then-lora":
        report = patch_model(model, family="relu-sum", example_input=x)
        model = _lora(model)
    else:
        model = _lora(model)
        report = patch_model(model, family="relu-sum", example_input=x)
    assert len(report.norms) == 5 and len(report.activations) == 2
    assert sum(isinstance(m, MSLayerNorm) for m in model.modules()) == 5
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(**x).logits, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("order", ["lora-then-patch", "patch-then-lora"])
@pytest.mark.parametrize("adapter_fp32", [True, False])
def test_lora_saving_per_block_matches_the_frozen_linear_column(order, adapter_fp32):
    """Saved bytes per token·d (bf16 block, LoRA r=4 on q, v): exact LoRA − patched LoRA equals the memory table's
    frozen column (baseline − ReGELU2 + MS-LN). With bf16 adapters it is 2 more: lora_A saves the LayerNorm's bf16
    output in the exact block, while ours shares the MS-norm's z. (peft's default fp32 adapters save an fp32 copy
    in both.)"""
    kw = dict(d=64, hidden=256, heads=4)
    cfg = peft.LoraConfig(r=4, target_modules=["q", "v"])

    def build():
        torch.manual_seed(0)
        return ViTBlock(**kw).to(torch.bfloat16)

    x = torch.randn(2, 197, 64, dtype=torch.bfloat16, requires_grad=True)
    exact = peft.get_peft_model(build(), cfg, autocast_adapter_dtype=adapter_fp32)
    if order == "patch-then-lora":
        block = build()
        patch_model(block, family="relu-sum", example_input=x)
        ours = peft.get_peft_model(block, cfg, autocast_adapter_dtype=adapter_fp32)
        patch_model(ours, family=None, example_input=x)  # the adapters get α, β (exact LoRA)
    else:
        ours = peft.get_peft_model(build(), cfg, autocast_adapter_dtype=adapter_fp32)
        patch_model(ours, family="relu-sum", example_input=x)

    def per_token_d(model):
        """Saved bytes per token·d as the slope between 197 and 394 tokens: per-call constants such as the
        adapters' r×d product W·diag α cancel."""
        x2 = torch.randn(2, 394, 64, dtype=torch.bfloat16, requires_grad=True)
        saved = [saved_bytes(lambda v=v: model(v), exclude=[*model.parameters(), *model.buffers()]) for v in (x, x2)]
        return (saved[1] - saved[0]) / (x2.numel() - x.numel())

    column = (saved_per_token_per_d(ViTBlock, "baseline", frozen=True, **kw)
              - saved_per_token_per_d(ViTBlock, "relu-sum", frozen=True, **kw))
    saving = per_token_d(exact) - per_token_d(ours)
    print(f"{order}, fp32 adapters {adapter_fp32}: saving {saving:.4f} bytes/token·d, frozen column {column:.4f}")
    assert saving == pytest.approx(column + (0 if adapter_fp32 else 2), abs=1e-9)


def test_patch_lora_patch_again_makes_the_adapters_exact():
    """Patch, then LoRA, then patch again: the new adapters get the norms' α, β (kept as the model's parameters,
    since the first patch saw a trainable model), so their gradients equal those of LoRA on the unpatched model;
    a further call changes nothing."""
    model, x, labels = _vit()
    ref = _lora(copy.deepcopy(model))
    patch_model(model, family=None, example_input=x)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))  # B = 0: wrapping changes no output yet
    report = patch_model(model, family=None, example_input=x)
    assert len(report.norms) == 2 and all("patched before" in n for n in report.norms), report  # ln_before × 2
    with torch.no_grad():  # then the reference's adapter weights (B ≠ 0), as if trained
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(ref_params[n])
    assert sum(isinstance(m, NormInputLinear) and "lora_A" in n for n, m in model.named_modules()) == 4
    g, g_ref = _grads(model, x, labels), _grads(ref, x, labels)
    assert sorted(g) == sorted(g_ref)
    for name in g:
        assert torch.allclose(g[name], g_ref[name], rtol=1e-9, atol=1e-12), name
    again = patch_model(model, family=None, example_input=x)
    assert not again.norms and not again.skipped and again.max_output_difference == 0


def test_a_patched_frozen_model_keeps_the_stock_state_dict_layout():
    """Nothing is merged into a weight (α, β stay the norms' own Parameters): the patched model's state dict is the
    stock one, saved without a warning and loaded by the stock class."""
    model, x, _ = _vit()
    model.requires_grad_(False)  # frozen: the paper's LoRA setting
    stock = copy.deepcopy(model)
    report = patch_model(model, family=None, example_input=x)
    assert report.norms, report
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = model.state_dict()
        assert own.keys() == stock.state_dict().keys()
        stock.load_state_dict(patched_state_dict(model))


def test_norms_kept_in_fp32_over_a_16_bit_base_are_left_as_they_are():
    """QLoRA's script keeps the norms' weights in fp32 over a bf16 model: α⊙z is then fp32, which a merged form
    computing in the Linears' bf16 would not be. The norms are skipped with that reason; the output is unchanged."""
    from approxbp.planner.training import Setup

    torch.manual_seed(0)
    setup = Setup(weights="nf4", norms="fp32", autocast="bf16", train="lora", adapters="bf16",
                  lora_targets="all-linear")
    with SU.weights_for(setup):
        model, inputs = MD.model_spec("llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100")()
        model = SM.prepare(model, setup, 8)
    for name, p in model.named_parameters():
        if "lora_B" in name or "norm" in name:
            torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.2)
    x = inputs(2, 8)
    patched = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(**x).logits
        report = patch_model(patched, family=None, norms=True, example_input=x)
        got = patched(**x).logits
    assert not report.norms and sum("float32 weights promote" in s for s in report.skipped) == 5
    assert torch.equal(want, got)


@pytest.mark.parametrize("lora", [dict(r=4, target_modules=["q_proj", "v_proj"]),
                                  dict(r=4, target_modules="all-linear"),
                                  dict(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1),
                                  dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)],
                         ids=["qv", "all-linear", "dropout", "random-init"])
def test_peft_added_after_patching_reads_the_stock_values(lora):
    """Patch, then peft LoRA (the usual order when a patched model goes to a trainer): lora_A read the MS-norm's z
    in place of α⊙z + β (logits 0.27 relative off with loaded adapters; first lora_B gradients 0.365 off). The norms
    return the stock value now: logits and every adapter gradient equal the stock model's with the same adapters,
    in train mode (the same dropout masks) and eval mode; patching again makes the adapters save the shared z."""
    model, x, labels = _vit()
    stock = copy.deepcopy(model)
    patch_model(model, family=None, example_input=x)  # the exact rewrites: any difference is a wrong value
    pair = [peft.get_peft_model(m, peft.LoraConfig(**lora)) for m in (stock, model)]
    adapters = {n: p for n, p in pair[0].named_parameters() if "lora_" in n}
    with torch.no_grad():  # the same adapters in both (B ≠ 0: loaded ones, as a trained checkpoint's)
        for name, p in adapters.items():
            if "lora_B" in name:
                p.normal_()
        ours = {n: p for n, p in pair[1].named_parameters() if "lora_" in n}
        assert ours.keys() == adapters.keys()
        for name, p in ours.items():
            p.copy_(adapters[name])
    for again in (False, True):
        if again:
            report = patch_model(pair[1], family=None, example_input=x)
            assert report.max_output_difference < 1e-9, report
        for training in (True, False):
            grads = []
            for m in pair:
                m.train(training)
                torch.manual_seed(11)
                grads.append(_grads(m, x, labels))
            torch.manual_seed(11)
            want = pair[0](**x).logits
            torch.manual_seed(11)
            torch.testing.assert_close(pair[1](**x).logits, want, rtol=1e-9, atol=1e-9)
            assert grads[0].keys() == grads[1].keys()
            for k in grads[0]:
                torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-9, atol=1e-12, msg=k)
