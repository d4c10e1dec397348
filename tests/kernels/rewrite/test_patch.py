"""patch_model on ViT- and LLaMA-style blocks: what changes, what stays, and a training step."""

import copy

import pytest
import torch
from approxbp.kernels import (
    MSLayerNorm,
    MSRMSNorm,
    ReGELU2,
    ReSiLU2,
    patch_model,
)

from approxbp import blocks


@pytest.mark.parametrize("cls,act,normcls", [(blocks.ViTBlock, ReGELU2, MSLayerNorm),
                                             (blocks.LlamaBlock, ReSiLU2, MSRMSNorm)])
def test_patch_preserves_forward_and_gradients_stay_close(cls, act, normcls):
    torch.manual_seed(0)
    base = cls().double()
    for m in base.modules():  # non-trivial affine so that merging matters
        if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 1:
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    ours = copy.deepcopy(base)
    report = patch_model(ours)
    assert len(report.norms) == 2 and len(report.activations) == 1 and not report.skipped
    assert any(isinstance(m, act) for m in ours.modules())
    assert sum(isinstance(m, normcls) for m in ours.modules()) == 2
    x = torch.randn(2, 9, base.attn.q.in_features, dtype=torch.float64)
    assert torch.allclose(ours(x), base(x), rtol=1e-10, atol=1e-10)  # forward is exact
    # one training step: gradients w.r.t. the input and an unmerged weight, approximate vs exact backward
    xb, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gb = torch.autograd.grad(base(xb).pow(2).mean(), [xb, base.attn.o.weight])
    go = torch.autograd.grad(ours(xo).pow(2).mean(), [xo, ours.attn.o.weight])
    for a, b in zip(gb, go):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cos > 0.99, float(cos)


def test_untraceable_model_is_reported_not_broken():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.lin, self.act = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4), torch.nn.GELU()

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                x = x * 2
            return self.act(self.lin(self.ln(x)))

    m = Branchy()
    report = patch_model(m)
    assert "not fx-traceable" in report.skipped[0] and isinstance(m.act, ReGELU2)
    assert isinstance(m.ln, torch.nn.LayerNorm)


def test_bad_family_or_table_choice():
    with pytest.raises(ValueError, match="family must be one of"):
        patch_model(torch.nn.Linear(2, 2), family="relu")
    with pytest.raises(ValueError, match="tables must be a table path"):
        patch_model(torch.nn.Linear(2, 2), tables="no-such-table")
    from approxbp.kernels.rewrite.patch import PatchConfig

    with pytest.raises(ValueError, match="family must be one of"):  # a config is checked when it is made
        PatchConfig(family="relu")


class _TwiceNorm(torch.nn.Module):
    """One LayerNorm called on two inputs; the second call's output feeds a non-Linear op."""

    def __init__(self, untraceable=False):
        super().__init__()
        self.ln, self.a = torch.nn.LayerNorm(6), torch.nn.Linear(6, 6)
        self.untraceable = untraceable

    def forward(self, x):
        if self.untraceable:  # int() of a shape: fx cannot trace it (no data-dependent branch, dynamo can)
            x = x * (int(x.shape[-1]) // 6)
        return self.ln(2 * x).tanh() + self.a(self.ln(x))  # the last call site feeds only the Linear


class _ReusedConsumer(_TwiceNorm):
    """A consumer Linear also applied to a tensor that is not the norm's output."""

    def forward(self, x):
        if self.untraceable:
            x = x * (int(x.shape[-1]) // 6)
        return self.a(self.ln(x)) + self.a(x)


class _TwoNormsOneLinear(_TwiceNorm):
    """One Linear fed by two different norms."""

    def __init__(self, untraceable=False):
        super().__init__(untraceable)
        self.ln2 = torch.nn.LayerNorm(6)

    def forward(self, x):
        if self.untraceable:
            x = x * (int(x.shape[-1]) // 6)
        return self.a(self.ln(x)) + self.a(self.ln2(x * 3))


@pytest.mark.parametrize("cls", [_TwiceNorm, _ReusedConsumer, _TwoNormsOneLinear])
@pytest.mark.parametrize("untraceable", [False, True], ids=["fx", "dispatch"])
def test_every_call_site_is_accounted_for(cls, untraceable):
    """A norm called twice, a consumer reused on another input, a Linear fed by two norms (rewriting the value a norm
    returned changed the output by 0.5–1.9 in fp64 before): the norm returns the stock value, so every call site
    reads what it read in the stock model, outputs and gradients alike, on both paths."""
    torch.manual_seed(0)
    m = cls(untraceable).double()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.normal_(1.0, 0.5)
                mod.bias.normal_(0.0, 0.5)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    before = m(x)
    x_grad = torch.autograd.grad(before.square().sum(), x)[0]
    for frozen in (False, True):
        mm = copy.deepcopy(m).requires_grad_(not frozen)
        report = patch_model(mm, family=None, example_input=x.detach() if untraceable else None)
        assert report.norms, report
        after = mm(x)
        assert torch.allclose(after, before, rtol=1e-12, atol=1e-12)
        got = torch.autograd.grad(after.square().sum(), x)[0]
        assert torch.allclose(got, x_grad, rtol=1e-10, atol=1e-12)


def test_a_norm_rewritten_on_one_branch_gives_the_stock_value_on_the_other():
    """The example takes one branch; the other reads the norm's output outside a Linear (before the shared-output
    norm, a rewrite proven on one branch changed the other branch's output by 5.8, so a model that branched on tensor
    values kept its norms). The rewrite now changes only what is saved: the untaken branch computes the stock value
    and gradient (to rounding: MS-LN computes α⊙z + β in two ops)."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.lin = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.lin(self.ln(x))
            return self.ln(x) * 2

    torch.manual_seed(0)
    m = Branchy().double()
    with torch.no_grad():
        m.ln.weight.normal_(1.0, 0.5)
        m.ln.bias.normal_(0.0, 0.5)
    pos, neg = torch.ones(2, 4, dtype=torch.float64), -torch.ones(2, 4, dtype=torch.float64) + 0.1 * torch.arange(4)
    stock = copy.deepcopy(m)
    report = patch_model(m, family=None, example_input=pos)
    assert len(report.norms) == 1, report
    for x in (pos, neg):
        for model in (stock, m):
            model.zero_grad()
            model(x).square().sum().backward()
        torch.testing.assert_close(m(x), stock(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m.ln.weight.grad, stock.ln.weight.grad, rtol=1e-12, atol=1e-12)


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----


def test_multi_dim_layernorm_is_skipped_not_broken():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm((8, 8)), torch.nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.normal_()
        model[0].bias.normal_()
    x = torch.randn(5, 8, 8)
    before = model(x)
    report = patch_model(model, family=None)
    assert isinstance(model[0], torch.nn.LayerNorm) and "normalises over (8, 8)" in str(report.skipped)
    assert torch.equal(model(x), before)


@pytest.mark.parametrize("frozen", [True, False])  # merged into frozen consumers / α, β kept for trainable ones
def test_patching_is_all_or_nothing(monkeypatch, frozen):
    from approxbp.kernels.rewrite import norm_patch as P

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8, bias=False), torch.nn.GELU(),
                                torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    for ln in (model[0], model[3]):
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
    model.requires_grad_(not frozen)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def flaky(norm, consumers, **kw):
        calls.append(norm)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(norm, consumers, **kw)

    real = P.keep_affine
    monkeypatch.setattr(P, "keep_affine", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        patch_model(model)
    assert [type(m) for m in model] == [torch.nn.LayerNorm, torch.nn.Linear, torch.nn.GELU, torch.nn.LayerNorm,
                                        torch.nn.Linear]
    assert model[1].bias is None
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)


def test_a_tied_consumer_weight_stays_tied():
    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(11, 8)
            self.ln_f = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 11, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

        def forward(self, ids):
            return self.lm_head(self.ln_f(self.wte(ids)))

    torch.manual_seed(0)
    m = TinyLM().double()
    with torch.no_grad():
        m.ln_f.weight.normal_()
        m.ln_f.bias.normal_()
    ids = torch.randint(0, 11, (2, 5))
    before = m(ids)
    frozen = copy.deepcopy(m).requires_grad_(False)
    for model in (frozen, m):  # no weight is ever rewritten (α, β stay the norm's): tying is no obstacle
        report = patch_model(model, family=None)
        assert len(report.norms) == 1 and model.lm_head.weight is model.wte.weight
        assert (model(ids) - before).abs().max() <= 1e-12


class _Block(torch.nn.Module):
    def __init__(self, branchy=False):
        super().__init__()
        self.ln, self.lin, self.branchy = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4), branchy

    def forward(self, x):
        z = self.lin(self.ln(x))
        return z * 2 if self.branchy and bool(z.sum() > 0) else z


class _CountsTokens(torch.nn.Module):
    """A vision-language model's top level: it counts image tokens with .item(); its blocks are static."""

    def __init__(self, branchy_second=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block(branchy_second)])

    def forward(self, x):
        n = int((x > 0).sum().item())
        x = x + n * 1e-3
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("branchy_second", [False, True])
def test_a_branch_at_the_top_level_or_in_a_block_keeps_every_norm(branchy_second):
    """One .item() anywhere once turned off every norm rewrite (15 HF vision-language models lost their language
    towers' norms), then every norm of a block that branched. Neither stops it now: the rewrite changes no value any
    reader sees, so the patched model equals stock on the example and on an input that takes the other branches."""
    torch.manual_seed(0)
    m = _CountsTokens(branchy_second).double()
    with torch.no_grad():
        for b in m.blocks:
            b.ln.weight.normal_(1.0, 0.5)
    stock = copy.deepcopy(m)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    report = patch_model(m, family=None, example_input=x)
    assert len(report.norms) == 2 and not report.skipped, report
    for inp in (x, -x, x.abs()):
        torch.testing.assert_close(m(inp), stock(inp), rtol=1e-12, atol=1e-12)


def test_twelve_branching_blocks_of_one_class_keep_their_norms():
    """Twelve blocks of one class that branch on tensor values (more than dynamo's per-code recompile limit, which
    once made the proof explain each block on its own): every norm is rewritten and the model computes as stock."""

    class Many(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([_Block(True) for _ in range(12)])

        def forward(self, x):
            x = x + int((x > 0).sum().item()) * 1e-3
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    m = Many().double()
    stock = copy.deepcopy(m)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    report = patch_model(m, family=None, example_input=x)
    assert len(report.norms) == 12 and not report.skipped, report
    for inp in (x, -x):
        torch.testing.assert_close(m(inp), stock(inp), rtol=1e-12, atol=1e-12)
