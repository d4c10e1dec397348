"""Every activation mapped to its tables, the table or k chosen by the user, tied weights
left alone, and the example input checked before and after."""

import pytest
import torch
from _helpers import exported
from approxbp.approximations import tables as table_files
from approxbp.kernels import InvActivation, ReGELU2, ReLUSumActivation, patch_model
from torch import nn

from approxbp.planner import plan_step as PS


def _mlp(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), act, nn.Linear(6, 2)).double()


@pytest.mark.parametrize("act,table", [(nn.GELU(approximate="tanh"), "gelu_tanh-k2-primitive"),
                                       (nn.Mish(), "mish-k2-primitive"), (nn.SiLU(), "silu-k2-primitive"),
                                       (nn.GELU(), "gelu-k2-primitive")])
def test_every_torch_activation_is_mapped(act, table):
    m = _mlp(act)
    x = torch.randn(3, 6, dtype=torch.float64)
    report = patch_model(m, norms=False, example_input=x)
    assert len(report.activations) == 1 and table in report.activations[0], report
    assert report.max_output_difference <= 1e-12  # the forward is exact


def test_bits_table_path_and_mapping(tmp_path):
    m = _mlp(nn.GELU())
    patch_model(m, norms=False, bits=3)
    assert isinstance(m[1], ReLUSumActivation) and m[1].spec.bits == 3
    path = exported(table_files.load("invact/gelu-fast"), tmp_path / "mine.json")
    m = _mlp(nn.GELU())
    patch_model(m, tables=str(path), norms=False)
    assert isinstance(m[1], InvActivation)
    m = _mlp(nn.SiLU())
    patch_model(m, family=None, tables={nn.SiLU: "relu_sum/silu-k4-derivative"}, norms=False)
    assert m[1].spec.table["bits"] == 4 and m[1].spec.table["objective"] == "derivative"


def test_unreplaced_activation_like_modules_are_reported():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
    report = patch_model(m, norms=False)
    relu, tanh = report.skipped
    assert "nothing to gain" in relu and "no table family" in tanh  # ReLU saves only its output already
    assert not isinstance(m[1], ReGELU2)


def test_gpt2_gelu_new_is_swapped_and_its_conv1d_norm_consumers_and_tied_lm_head_are_patched():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    with torch.no_grad():  # a "pretrained" checkpoint: norms away from their init values
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.normal_(1.0, 0.3)
                mod.bias.normal_(0.0, 0.3)
    ids = torch.randint(0, 64, (2, 16))
    report = patch_model(model, family="relu-sum", example_input={"input_ids": ids})
    assert sum("NewGELUActivation" in a for a in report.activations) == 12, report.activations
    assert len(report.norms) == 25, report  # ln_1, ln_2 (Conv1D consumers) × 12; ln_f: its output shared
    assert not report.skipped and "transformer.ln_f → MSLayerNormSharedOutput" in report.norms[-1], report
    assert report.max_output_difference <= 1e-6
    assert model.lm_head.weight is model.transformer.wte.weight  # tying untouched: α, β are applied, not merged


def test_a_patch_that_changes_the_output_is_undone():
    class Odd(nn.Module):  # an activation-like module whose "replacement" computes something else
        def forward(self, x):
            return x * 2

    m = _mlp(nn.GELU())
    x = torch.randn(3, 6, dtype=torch.float64)
    before = m(x)
    report = patch_model(m, family=None, tables={nn.GELU: Odd()}, norms=False, example_input=x)  # checked first
    assert "computes another function" in report.skipped[0] and not report.activations
    assert isinstance(m[1], nn.GELU) and torch.equal(m(x), before)


@pytest.mark.parametrize("table", ["relu_sum/gelu-k2-primitive", "invact/gelu-fast"])
def test_a_table_of_another_activation_is_not_swapped_in(table):
    m = _mlp(nn.SiLU())
    report = patch_model(m, tables=table, norms=False)
    assert isinstance(m[1], nn.SiLU) and "computes another function" in report.skipped[0], report


def test_hooks_on_a_replaced_activation_keep_firing():
    m = _mlp(nn.GELU())
    seen = []
    m[1].register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    m[1].register_forward_pre_hook(lambda mod, inp: seen.append("pre"))
    patch_model(m, family="relu-sum", norms=False)
    m(torch.randn(3, 6, dtype=torch.float64))
    assert type(m[1]).__name__ == "ReGELU2" and seen == ["pre", torch.Size([3, 6])]


def _stock(seed=0):
    from approxbp.blocks import GPTBlock

    torch.manual_seed(seed)
    m = nn.Sequential(GPTBlock(d=16, hidden=32, heads=2), GPTBlock(d=16, hidden=32, heads=2), nn.LayerNorm(16),
                      nn.Linear(16, 5, bias=False)).double()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.normal_(1.0, 0.3)
                mod.bias.normal_(0.0, 0.3)
    return m


def test_patched_state_dict_loads_into_the_stock_model_and_unpatch_restores():
    """A patched model's weights go back into the stock architecture with identical outputs."""
    from approxbp.kernels import patched_state_dict, unpatch

    x = torch.randn(2, 7, 16, dtype=torch.float64)
    model = _stock()
    reference = model(x)
    report = patch_model(model, family="invact")
    assert len(report.norms) == 5 and len(report.activations) == 2
    stock = _stock(seed=1)  # other weights, to be overwritten
    stock.load_state_dict(patched_state_dict(model))  # strict: every key of the stock model, none extra
    assert (stock(x) - reference).abs().max() <= 1e-12
    assert "MSLayerNorm" in str(model)  # the patched model stays patched
    unpatch(model)
    assert "MSLayerNorm" not in str(model) and "InvAct" not in str(model)
    assert (model(x) - reference).abs().max() <= 1e-12
    assert model[3].bias is None  # a bias the merge had to create is gone again


def test_accurate_gelu_is_swapped_and_hardswish_takes_the_family_that_has_its_table():
    """Hard-swish has ReLU-sum tables (issue 47) and no InvAct one: the relu-sum family swaps it; the invact family
    skips it naming the family that has one (it raised FileNotFoundError)."""
    pytest.importorskip("transformers")
    from transformers.activations import AccurateGELUActivation

    m = nn.Sequential(nn.Linear(6, 6), AccurateGELUActivation(), nn.Linear(6, 6), nn.Hardswish()).double()
    report = patch_model(m, family="relu-sum", norms=False)
    assert type(m[1]).__name__ == "ReLUSumActivation" and "gelu_tanh-k2-primitive" in report.activations[0]
    assert type(m[3]).__name__ == "ReLUSumActivation" and "hardswish-k2-primitive" in report.activations[1]
    m = nn.Sequential(nn.Linear(6, 6), nn.Hardswish()).double()
    report = patch_model(m, family="invact", norms=False)
    assert isinstance(m[1], nn.Hardswish), report
    assert any("no packaged table invact/hardswish-fast; family='relu-sum' has relu_sum/hardswish-k2-primitive" in s
               for s in report.skipped), report


def test_the_report_says_each_drop_ins_gradient_error():
    """Where the user chooses, the price is said: the ReLU-sum table's E_N(0,1)[(h̃′ − f′)²]^½ and InvAct's certified
    L∞, the same numbers the planner weighs (approxbp.planner.plan_step.gradient_error)."""

    for family, option in (("relu-sum", "relu-sum-k2"), ("invact", "invact")):
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        line = patch_model(model, family=family, example_input=torch.randn(2, 8)).activations[0]
        assert f"gradient error {PS.gradient_error('gelu', option):.2g}" in line
    assert 0.2 < PS.gradient_error("gelu", "relu-sum-k2") < 0.3 and PS.gradient_error("gelu", "invact") < 1e-6
