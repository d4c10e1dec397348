"""patch_model on gated MLPs: found by what they run (split or fused gate/up, the
activation as a module or a function), proven in float64, replaced by the exact fused GLU, which trains exactly as
the stock model (activations called as functions elsewhere: test_patch_functional.py); a rewrite that saves nothing
is undone."""

import copy

import pytest
import torch
import torch.nn.functional as F
from approxbp.kernels import patch_model, unpatch
from approxbp.kernels.ops.glu import GatedMLP
from torch import nn


class SplitMLP(nn.Module):
    def __init__(self, d=16, f=32, up_first=False):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)
        self.act_fn, self.up_first = nn.SiLU(), up_first

    def forward(self, x):
        if self.up_first:
            up = self.up_proj(x)
            return self.down_proj(self.act_fn(self.gate_proj(x)) * up)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedMLP(nn.Module):
    """Phi-3's layout: one gate_up projection, chunked; the up half first here, and GELU-tanh as a function."""

    def __init__(self, d=16, f=32):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class FusedModuleMLP(FusedMLP):
    def __init__(self, d=16, f=32):
        super().__init__(d, f)
        self.act = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class NotQuite(SplitMLP):
    """act(gate)·up + up: reads like a gated MLP, computes something else."""

    def forward(self, x):
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * up + up)


class Block(nn.Module):
    def __init__(self, mlp, d=16):
        super().__init__()
        self.norm, self.mlp, self.head = nn.LayerNorm(d), mlp, nn.Linear(d, 3)

    def forward(self, x):
        return self.head(x + self.mlp(self.norm(x)))


def _model(mlp, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), Block(mlp)).double()


def _train_step(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mlp", [SplitMLP, lambda: SplitMLP(up_first=True), FusedMLP, FusedModuleMLP],
                         ids=["split", "split-up-first", "fused-functional", "fused-module"])
def test_gated_mlps_become_the_exact_fused_op_and_train_exactly(mlp):
    stock = _model(mlp())
    ours = copy.deepcopy(stock)
    x = torch.randn(4, 7, 16, dtype=torch.float64)
    report = patch_model(ours, family="relu-sum", example_input=x)
    assert len(report.glus) == 1 and isinstance(ours[1].mlp, GatedMLP), report
    assert not report.activations and not report.skipped, report
    before, after = report.saved_bytes
    assert after < before
    assert ours.state_dict().keys() == stock.state_dict().keys()
    (y0, g0), (y1, g1) = _train_step(stock, x), _train_step(ours, x)
    assert torch.allclose(y0, y1, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(g0, g1))


def test_a_module_that_only_looks_gated_is_skipped_with_the_reason():
    model = _model(NotQuite())
    report = patch_model(model, family="invact", example_input=torch.randn(2, 16, dtype=torch.float64))
    assert not report.glus and len(report.activations) == 1  # its activation is still swapped
    assert any("1.mlp (NotQuite): does not compute down(act(gate)·up)" in s for s in report.skipped), report


def test_an_activation_with_hooks_keeps_its_mlp():
    model = _model(SplitMLP())
    model[1].mlp.act_fn.register_forward_hook(lambda m, i, o: None)
    report = patch_model(model, family=None, example_input=torch.randn(2, 16, dtype=torch.float64))
    assert not report.glus and any("activation act_fn has forward hooks" in s for s in report.skipped), report


def test_a_swap_that_saves_nothing_is_undone_and_said():
    """Cause 5: with a fused gate/up projection the product keeps the one gate_up storage alive, so an approximate
    activation's codes or output are saved on top of what stock saves. glu=False leaves only that swap to try."""
    stock = _model(FusedModuleMLP())
    model = copy.deepcopy(stock)
    x = torch.randn(4, 16, dtype=torch.float64)
    report = patch_model(model, family="relu-sum", example_input=x, glu=False)
    assert not report.activations and type(model[1].mlp.act) is nn.SiLU
    assert any(s.startswith("*.mlp.act (activations): saves nothing here") and s.endswith("kept as it was: 1.mlp.act")
               for s in report.skipped), report
    assert report.rewritten() == {"1.norm"}  # the module paths, read off every kind of report line
    (y0, g0), (y1, g1) = _train_step(stock, x), _train_step(model, x)
    assert torch.allclose(y0, y1) and all(torch.allclose(a, b) for a, b in zip(g0, g1))


def test_unpatch_gives_back_the_stock_mlp_with_its_own_children():
    stock = _model(SplitMLP())
    model = copy.deepcopy(stock)
    x = torch.randn(2, 16, dtype=torch.float64)
    patch_model(model, family="invact", example_input=x)  # the norm feeds gate and up: both wrapped
    unpatch(model)
    assert type(model[1].mlp) is SplitMLP and all(type(c) in (nn.Linear, nn.SiLU) for c in model[1].mlp.children())
    with torch.no_grad():
        assert torch.allclose(model(x), stock(x), rtol=1e-12)


def test_the_planner_keeps_per_activation_choices():
    model = _model(SplitMLP())
    report = patch_model(model, family="invact", example_input=torch.randn(2, 16, dtype=torch.float64),
                         glu=False)
    assert not report.glus and len(report.activations) == 1


def _hf(name):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config, model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                     "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[name]
    torch.manual_seed(0)
    return model(config(**kw)).double()


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_hf_swiglu_models_train_exactly_and_save_alike(name):
    """Phi-3 differs from Llama by its fused gate_up_proj: the fused op saves as much there (before: −0.3 %)."""
    stock = _hf(name)
    ours = copy.deepcopy(stock)
    ids = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    report = patch_model(ours, family="invact", example_input={"input_ids": ids})
    assert len(report.glus) == 2 and len(report.norms) == 5, report  # the final norm's output is shared
    before, after = report.saved_bytes
    print(f"{name}: saved for backward {before} → {after} bytes ({100 * (1 - after / before):.1f} % less)")
    assert 1 - after / before > 0.25, report.saved_bytes  # measured (-s prints it)
    losses = []
    for model in (stock, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(torch.tensor(run))
    rel = float(((losses[1] - losses[0]) / losses[0]).abs().max())
    assert rel <= 1e-6, rel  # HF computes its RMSNorm in float32 even in a float64 model: 4e-8 apart


class SizedMLP(FusedModuleMLP):
    """Splits its fused projection by a size it stored, which a narrowed proof cannot follow."""

    def __init__(self, d=16, f=32):
        super().__init__(d, f)
        self.f = f

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.f, dim=-1)
        return self.down_proj(self.act(gate) * up)


@pytest.mark.parametrize("mlp, fused", [(lambda: SplitMLP(64, 192), True), (lambda: FusedModuleMLP(64, 192), True),
                                        (lambda: NotQuite(64, 192), False), (lambda: SizedMLP(64, 192), False)],
                         ids=["split", "fused", "not-quite", "sized"])
def test_an_mlp_too_wide_for_a_float64_twin_is_proven_narrowed(monkeypatch, mlp, fused):
    """A 405B MLP's float64 twin would take 21 GB: over the proof's size its widths are divided by a common factor
    (here 64, 192 and 384 by 4), which keeps 2·i twice i; what is not proven that way is left as it is."""
    from approxbp.kernels.rewrite import glu_forms

    monkeypatch.setattr(glu_forms, "PROOF_NUMEL", 1000)
    monkeypatch.setattr(glu_forms, "_PROVEN", type(glu_forms._PROVEN)())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), Block(mlp(), d=64)).double()
    stock = copy.deepcopy(model)
    assert glu_forms._narrowing(model[1].mlp, 64) == 4
    report = patch_model(model, family=None, norms=False, example_input=torch.randn(2, 5, 64, dtype=torch.float64))
    assert isinstance(model[1].mlp, GatedMLP) == fused, report
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.allclose(model(x), stock(x), rtol=1e-12, atol=1e-12)


class ScaledMLP(SplitMLP):
    """Gated, with a plain tensor attribute (not a parameter or buffer) that the forward reads."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * (self.up_proj(x) * self.scale))


def test_a_proof_is_never_reused_for_a_module_that_reads_another_tensor():
    """Two instances differing only in a tensor attribute shared one cached proof (keyed on class, scalars and
    shapes): with check=False, the second was fused and its output was off by 0.091."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    for scale in (torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)):
        stock = nn.Sequential(ScaledMLP(scale)).double()
        model = copy.deepcopy(stock)
        report = patch_model(model, family=None, norms=False, example_input=x, check=False)
        torch.testing.assert_close(model(x), stock(x), rtol=1e-12, atol=1e-12, msg=str(report))


def test_full_backward_hooks_keep_firing_on_a_fused_mlp_and_a_swapped_activation():
    """register_full_backward_hook on a gated MLP and on its activation was copied without the module's "full" flag:
    stock fired ['act', 'mlp'], patched []. Now both fire, with the stock gradients for the MLP's output."""
    torch.manual_seed(0)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.act = SplitMLP(), nn.GELU()

        def forward(self, x):
            return self.act(self.mlp(x))

    stock = Outer().double()
    model = copy.deepcopy(stock)
    fired = {"stock": [], "patched": []}
    for key, m in (("stock", stock), ("patched", model)):
        m.act.register_full_backward_hook(lambda mod, gi, go, key=key: fired[key].append(("act", go[0].clone())))
        m.mlp.register_full_backward_hook(lambda mod, gi, go, key=key: fired[key].append(("mlp", go[0].clone())))
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    report = patch_model(model, family="relu-sum", example_input=x)
    assert report.glus and report.activations, report
    for m in (stock, model):
        m(x.clone().requires_grad_(True)).square().sum().backward()
    assert [k for k, _ in fired["patched"]] == [k for k, _ in fired["stock"]] == ["act", "mlp"]
    torch.testing.assert_close(fired["patched"][0][1], fired["stock"][0][1], rtol=1e-9, atol=1e-12)


class TrainScaledMLP(SplitMLP):
    """Gated, with a scale only in training: its float64 proof (eval mode) passes, the train-mode check does not."""

    def forward(self, x):
        up = self.up_proj(x) * (2.0 if self.training else 1.0)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * up)


def test_one_module_that_cannot_be_proven_is_skipped_and_the_rest_stay_patched():
    """A gated MLP with a training-only scale failed the whole call ("patching changed output … the model is
    restored"), losing every other rewrite. Now that module alone is skipped with its reason."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([SplitMLP(), TrainScaledMLP()])
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return self.head(self.norm(x))

    stock = Two().double()
    model = copy.deepcopy(stock)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    report = patch_model(model, family=None, example_input=x)
    assert [g.split(":")[0] for g in report.glus] == ["layers.0"], report
    # refused before any proof runs: its forward traces to another graph in training than in eval (issue 59)
    assert any(s.startswith("layers.1 (TrainScaledMLP): its forward differs between training and eval")
               for s in report.skipped), report
    assert report.norms, report
    for training in (False, True):
        model.train(training), stock.train(training)
        torch.testing.assert_close(model(x), stock(x), rtol=1e-9, atol=1e-12)


class LengthBranchMLP(SplitMLP):
    """Gated on short inputs, something else on long ones: a proof on an example of ≤ 8 rows cannot see it."""

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if x.shape[-2] > 8:
            h = h * 0.5
        return self.down_proj(h)


def test_a_gated_mlp_that_branches_on_its_input_is_skipped_not_proven_by_example():
    """Issue 59 item 1: a gated MLP whose forward branches on the sequence length passed the proof on the example
    (and its probe of ≤ 8 rows), and the patched model then returned other values on a longer input (0.108), with
    no warning. Its forward does not trace to one fixed graph (torch.fx stops at the branch): skipped with the
    reason, so the patched model is stock on every length; the plain gated MLP beside it is still fused."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = SplitMLP(), LengthBranchMLP()

        def forward(self, x):
            return self.b(x + self.a(x))

    stock = Two().double()
    model = copy.deepcopy(stock)
    report = patch_model(model, family=None, norms=False, example_input=torch.randn(2, 4, 16, dtype=torch.float64))
    assert [g.split(":")[0] for g in report.glus] == ["a"], report
    assert any(s.startswith("b (LengthBranchMLP): its forward is not one fixed graph") for s in report.skipped), report
    for rows in (4, 32):
        x = torch.randn(2, rows, 16, dtype=torch.float64)
        torch.testing.assert_close(model(x), stock(x), rtol=1e-12, atol=1e-12)


def test_the_proof_cache_keeps_only_the_most_recently_used(monkeypatch):
    from approxbp.kernels.rewrite import glu_forms

    cache = type(glu_forms._PROVEN)()
    monkeypatch.setattr(glu_forms, "_PROVEN", cache)
    monkeypatch.setattr(glu_forms, "_PROVEN_KEPT", 2)
    monkeypatch.setattr(glu_forms, "_prove", lambda module, layout, act, shape: None)
    monkeypatch.setattr(glu_forms, "fixed_graph", lambda module: None)
    for key in ("a", "b", "a", "c"):
        monkeypatch.setattr(glu_forms, "_proof_key", lambda *args, key=key: key)
        glu_forms.prove(None, None, "silu", None)
    assert list(cache) == ["a", "c"]  # b, the least recently used, dropped
