"""patch_model's keyword-only interface: a typed config, a module filter, tables that override the family, and
0.1's arguments (positional, ``activation=``, ``norm=``, ``plan=``) refused with the model left as it was."""

import copy

import pytest
import torch
from approxbp.kernels import patch_model
from approxbp.kernels.rewrite.patch import PatchConfig
from torch import nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.SiLU(),
                         nn.Linear(8, 2)).double().requires_grad_(False)


def _kinds(model: nn.Module) -> list[str]:
    return [type(m).__name__ + (f"({m.spec.name()})" if hasattr(m, "spec") else "") for m in model]


X = torch.randn(3, 8, dtype=torch.float64)


def test_a_config_object_and_the_keywords_patch_alike():
    a, b = _model(), _model()
    patch_model(a, family="invact", norms=False, example_input=X)
    patch_model(b, config=PatchConfig(family="invact", norms=False), example_input=X)
    assert _kinds(a) == _kinds(b) and _kinds(a)[2] == "InvActGELU(gelu-fast)", _kinds(a)
    with pytest.raises(TypeError, match="positional"):
        patch_model(_model(), PatchConfig())
    with pytest.raises(TypeError, match=r"config=…\) takes no other rewrite arguments \(got norms\)"):
        patch_model(_model(), config=PatchConfig(), norms=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        patch_model(_model(), activations="invact")


def test_the_module_filter_leaves_what_it_refuses_and_says_so():
    model = _model()
    report = patch_model(model, example_input=X,
                         module_filter_fn=lambda module, fqn: fqn != "4" and not isinstance(module, nn.LayerNorm))
    assert isinstance(model[0], nn.LayerNorm) and isinstance(model[4], nn.SiLU) and not isinstance(model[2], nn.GELU)
    assert "0: left out by module_filter_fn" in report.skipped
    assert any(s.startswith("4 (SiLU): left out by module_filter_fn") for s in report.skipped), report.skipped


def test_tables_name_some_modules_and_the_family_serves_the_rest():
    model = _model()
    patch_model(model, family="invact", tables={nn.SiLU: "relu_sum/silu-k3-primitive"}, norms=False)
    assert "gelu-fast" in _kinds(model)[2] and "silu-k3-primitive" in _kinds(model)[4], _kinds(model)
    only = _model()
    report = patch_model(only, family=None, tables={"SiLU": "relu_sum/silu-k3-primitive"}, norms=False)
    assert isinstance(only[2], nn.GELU) and "2 (GELU): not in the tables mapping" in report.skipped


@pytest.mark.parametrize("call", [
    lambda m: patch_model(m, "invact", False),  # 0.1's positional activation, norm
    lambda m: patch_model(m, activation="relu-sum"),
    lambda m: patch_model(m, norm=False),
    lambda m: patch_model(m, plan="plan.json"),
])
def test_0_1_arguments_are_refused_and_the_model_left_as_it_was(call):
    """0.2 drops 0.1's spellings (CHANGELOG.md: family=/tables=, norms=, Plan.load(path).apply(model), keywords)."""
    model = _model()
    stock = copy.deepcopy(model)
    with pytest.raises(TypeError):
        call(model)
    assert [type(m) for m in model] == [type(m) for m in stock]


@pytest.mark.parametrize("kw, says", [
    (dict(norms="no"), "norms must be True or False, got 'no'"),
    (dict(bits=0), "bits must be an integer from 1 to 8"),
    (dict(bits=99), "bits must be an integer from 1 to 8"),
    (dict(glu="mlp"), "a single path goes in a list"),
    (dict(tables={"mlp.act": "no/such/table.json"}), "tables['mlp.act'] = 'no/such/table.json': no such table"),
])
def test_patch_config_refuses_bad_arguments_when_it_is_made(kw, says):
    """norms="no" was taken as true; bits 0 or 99 and a missing table in a mapping surfaced only at patch time; a
    plain string for glu was matched as a substring of module paths."""
    from approxbp.kernels.rewrite.common import PatchConfig

    with pytest.raises((TypeError, ValueError)) as err:
        PatchConfig(**kw)
    assert says in str(err.value)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, vocab_size=50)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("key", ["SiLU", nn.SiLU, "model.layers.0.mlp.act"])
def test_a_tables_key_that_matches_no_module_is_refused_naming_what_the_model_has(key):
    """Issue 59 item 3: tables={"SiLU": "my-table.json"} on a Hugging Face Llama (whose class is SiLUActivation)
    reported "swapped 2 activations" with the packaged table and never read the user's. A key that matches no
    module (path, class or class name) is an error that names the model's activation classes, and nothing is left
    patched."""
    model = _hf_llama()
    stock = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"matches no module of this model.*activation classes: SiLUActivation") as e:
        patch_model(model, glu=False, tables={key: "relu_sum/silu-k3-primitive"}, norms=False)
    if key == "SiLU":
        assert "did you mean 'SiLUActivation'?" in str(e.value)
    if key == "model.layers.0.mlp.act":
        assert "did you mean 'model.layers.0.mlp.act_fn'?" in str(e.value)
    assert [type(m) for m in model.modules()] == [type(m) for m in stock.modules()]
    report = patch_model(model, glu=False, tables={"SiLUActivation": "relu_sum/silu-k3-primitive"}, norms=False)
    assert report.activations and "silu-k3-primitive" in report.activations[0], report


def test_a_glu_path_that_matches_no_module_is_refused():
    """Issue 59 item 3: glu=[path] with a path the model lacks was reported as "not fused" (without an example)
    or passed over in silence (with one)."""
    model = _hf_llama()
    ids = torch.randint(0, 50, (1, 8))
    for example in (None, {"input_ids": ids}):
        with pytest.raises(ValueError, match=r"glu= names 'model.layers.0.mpl' \(did you mean 'model.layers.0.mlp'"):
            patch_model(model, glu=["model.layers.0.mpl"], example_input=example)
    report = patch_model(model, glu=["model.layers.0.mlp"], example_input={"input_ids": ids}, norms=False)
    assert report.glus and report.glus[0].startswith("model.layers.0.mlp:"), report


class _InPlaceAfter(nn.Module):
    """Four activations, each followed by an in-place writer of another kind, and one read as it is."""

    def __init__(self):
        super().__init__()
        self.inp, self.other = nn.Linear(8, 16), nn.Linear(8, 16)
        self.a, self.b, self.c, self.d, self.e = nn.GELU(), nn.SiLU(), nn.GELU(), nn.SiLU(), nn.GELU()
        self.drop = nn.Dropout(0.1, inplace=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        u = self.inp(x)
        a = self.a(u)
        a.mul_(2.0)
        b = self.drop(self.b(u))
        c = self.c(u)
        c += 1.0
        d = self.d(u).clamp_(max=3.0)
        return self.out(a + b + c + d + self.e(self.other(x)))


def test_an_in_place_writer_after_an_activation_skips_that_activation_only():
    """Issue 59 item 4: an in-place writer after a swapped activation (h.mul_, dropout(inplace=True), +=, clamp_)
    made patch_model raise and undo everything. Each such activation is now skipped with its reason; the one read
    as it is is swapped, and the model computes the stock outputs."""
    torch.manual_seed(0)
    model = _InPlaceAfter()
    stock = copy.deepcopy(model)
    x = torch.randn(4, 8)
    report = patch_model(model, example_input=x, norms=False)
    skipped = {s.split(":")[0]: s for s in report.skipped}
    for name in "abcd":
        assert "written in place after it" in skipped[name], report.skipped
        assert type(getattr(model, name)) is type(getattr(stock, name))
    assert [s.split(":")[0] for s in report.activations] == ["e"], report
    model.eval()
    stock.eval()
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-6)
