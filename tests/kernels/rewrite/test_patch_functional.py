"""Activations called as functions (F.gelu, F.silu, a module-level Hugging Face activation) are swapped at the call
site: the module's own calls go to the drop-in, its submodules' calls and in-place calls stay torch's, the forward
value is stock, the saved bytes fall, and unpatch, deepcopy and torch.compile see a plain module again."""

import copy

import torch
import torch.nn.functional as F
from approxbp.kernels import patch_model, unpatch
from approxbp.kernels.ops.saved import saved_bytes
from approxbp.kernels.rewrite.functional_swap import installed
from torch import nn


class Head(nn.Module):
    """RoBERTa's LM head in small: dense → gelu (a function) → layer norm → decoder."""

    def __init__(self, d=16):
        super().__init__()
        self.dense, self.norm, self.decoder = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 5)

    def forward(self, x):
        return self.decoder(self.norm(F.gelu(self.dense(x))))


_GELU = nn.GELU()  # RoBERTa's `gelu = get_activation("gelu")`: an instance outside the model, called as a function


class GlobalActivationHead(Head):
    def forward(self, x):
        return self.decoder(self.norm(_GELU(self.dense(x))))


class Inner(nn.Module):
    """A submodule that calls F.silu itself: the owner's call-site swap must not reach into it."""

    def forward(self, x):
        return F.silu(x)


class Mixer(nn.Module):
    """Mamba's pattern: silu of one projection, times another; an Inner submodule and an in-place call too."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b, self.inner, self.out = nn.Linear(d, d), nn.Linear(d, d), Inner(), nn.Linear(d, d)

    def forward(self, x):
        h = F.silu(self.a(x)) * self.b(x)
        return self.out(self.inner(h) + F.silu(self.b(x) * 2, inplace=True))


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_function_call_is_swapped_at_the_call_site_and_trains_as_its_drop_in():
    torch.manual_seed(0)
    stock = nn.Sequential(Head(), nn.Linear(5, 2)).double()
    model = copy.deepcopy(stock)
    x = torch.randn(4, 16, dtype=torch.float64)
    report = patch_model(model, family="invact", norms=False, example_input=x)
    assert report.activations == [s for s in report.activations if s.startswith("0: gelu called as a function")]
    assert len(report.activations) == 1 and "InvActGELU" in report.activations[0], report
    assert not report.skipped, report
    before, after = report.saved_bytes
    assert after < before  # the dense output is no longer kept for gelu's backward; y is (the norm saves it)
    (y0, g0), (y1, g1) = _grads(stock, x), _grads(model, x)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)  # the forward is exact
    for k in g0:  # InvAct GELU: |f′ error| ≤ 1e-6
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-5)


def test_a_module_level_activation_instance_is_swapped_too():
    torch.manual_seed(0)
    model = nn.Sequential(GlobalActivationHead(), nn.Linear(5, 2))
    x = torch.randn(4, 16)
    report = patch_model(model, family="relu-sum", norms=False, example_input=x)
    assert any(s.startswith("0: gelu called as a function in GlobalActivationHead → ReGELU2") for s in
               report.activations), report
    model(x).sum().backward()  # runs; the global instance itself is untouched outside the head
    assert type(_GELU) is nn.GELU and not installed(_GELU)


def test_only_the_owners_own_calls_are_swapped_and_in_place_calls_stay_torchs():
    torch.manual_seed(0)
    stock = nn.Sequential(Mixer(), nn.Linear(16, 2)).double()
    model = copy.deepcopy(stock)
    x = torch.randn(3, 16, dtype=torch.float64)
    report = patch_model(model, family="relu-sum", norms=False, example_input=x)
    subjects = [s.split(" called")[0] for s in report.activations]
    assert subjects == ["0: silu", "0.inner: silu"], report  # Inner is its own owner
    y = model(x)
    names = []

    def walk(fn):
        while fn is not None and fn not in seen:
            seen.add(fn)
            names.append(type(fn).__name__)
            for nxt, _ in fn.next_functions:
                walk(nxt)
    seen: set = set()
    walk(y.grad_fn)
    assert names.count("ReLUSumFunctionClassicBackward") == 2  # the owner's silu and Inner's, not the in-place one
    torch.testing.assert_close(y, stock(x), rtol=1e-12, atol=1e-12)


def test_unpatch_deepcopy_and_compile_see_plain_modules():
    torch.manual_seed(0)
    stock = nn.Sequential(Head(), nn.Linear(5, 2))
    model = copy.deepcopy(stock)
    x = torch.randn(4, 16)
    patch_model(model, family="relu-sum", norms=False, example_input=x)
    twin = copy.deepcopy(model)  # its own hooks and drop-ins
    assert installed(twin[0]) and installed(twin[0]) is not installed(model[0])
    with torch.no_grad():
        torch.testing.assert_close(twin(x), stock(x))
    compiled = torch.compile(model, backend="eager")  # dynamo: the hooks stand aside, torch's gelu runs
    torch.testing.assert_close(compiled(x), stock(x))
    unpatch(model)
    assert not installed(model[0]) and not model[0]._forward_pre_hooks and not model[0]._forward_hooks
    with torch.enable_grad():
        xs = x.requires_grad_(True)
        assert saved_bytes(lambda: model(xs)) == saved_bytes(lambda: stock(xs))


def test_a_call_site_swap_registers_no_hook_of_the_whole_process_and_unpatch_removes_every_hook_it_added():
    """The owner's own hooks enter and leave the mode, its submodules' own hooks count them running: nothing global
    (torch's process-wide module hooks stay empty during the call), and unpatch leaves no hook on any submodule,
    on the model and on a deep copy alike."""
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    model = nn.Sequential(Mixer(), nn.Linear(16, 2))
    x = torch.randn(3, 16)
    patch_model(model, family="relu-sum", norms=False, example_input=x)
    seen = []
    model[0].inner.register_forward_pre_hook(lambda m, a: seen.append(len(torch_module._global_forward_pre_hooks)))
    model(x)
    assert seen == [0]
    twin = copy.deepcopy(model)
    for m in (model, twin):
        unpatch(m)
        hooks = [(name, h) for name, sub in m.named_modules() for h in (*sub._forward_pre_hooks.values(),
                                                                        *sub._forward_hooks.values())
                 if "approxbp" in getattr(getattr(h, "func", h), "__module__", "")]
        assert not hooks, hooks
