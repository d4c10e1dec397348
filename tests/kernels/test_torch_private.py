"""Every private PyTorch API approxbp uses lives in ``kernels/ops/torch_private.py``; each is checked here against
the installed torch, so an upgrade that moves or changes one fails by name rather than somewhere deep in a rewrite."""

import torch
from approxbp.kernels.ops import torch_private as P
from torch import nn


def test_storage_keys_are_shared_by_views_and_differ_between_storages():
    a = torch.zeros(4)
    assert P.storage_key(a) == P.storage_key(a[1:]) == P.storage_key(a.view(2, 2))
    assert P.storage_key(a) != P.storage_key(torch.zeros(4))
    with P.FakeTensorMode():
        f = torch.zeros(3)
        assert isinstance(f, P.FakeTensor) and isinstance(P.storage_key(f), int)
        with P.unset_fake_temporarily():
            assert not isinstance(torch.zeros(1), P.FakeTensor)


def test_functorch_and_forward_ad_are_seen():
    seen = []

    def f(x):
        seen.append((P.functorch_wrapped(x), P.functorch_derivative_levels()))
        return (x * x).sum()

    torch.func.grad(f)(torch.ones(2))
    assert seen == [(True, 1)] and not P.functorch_wrapped(torch.ones(1)) and P.functorch_derivative_levels() == 0
    assert not P.forward_ad_active()
    with torch.autograd.forward_ad.dual_level():
        assert P.forward_ad_active()


def test_every_module_hook_table_exists_and_memtrackers_peak_update_is_there():
    m = nn.Linear(1, 1)
    assert all(isinstance(getattr(m, t), dict) for t in P.MODULE_HOOK_TABLES)
    from torch.distributed._tools.mem_tracker import MemTracker

    assert callable(getattr(MemTracker, P.MEMTRACKER_PEAK_UPDATE))


def test_the_dispatch_mode_pytree_and_compile_hooks_are_there():
    calls = []

    class Count(P.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        torch.ones(2) + 1
    assert calls and P.pytree.tree_leaves(({"a": 1}, [2])) == [1, 2]
    assert callable(P.lookup_backend("eager"))
    with P.patched_functorch_config(activation_memory_budget=0.5):
        import torch._functorch.config as config  # the knob itself, read back

        assert config.activation_memory_budget == 0.5
    P.dynamo_reset()
    assert callable(P.aot_eager_with_mode)
