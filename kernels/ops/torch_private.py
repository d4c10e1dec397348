"""Every private PyTorch API approxbp touches, in one home: a torch upgrade that moves or changes one of them breaks
here, by name, and ``tests/kernels/test_torch_private.py`` checks each against the installed torch (the list is in
docs/kernels.md, *Private PyTorch*). Nothing else in the tree imports ``torch._*`` or ``torch.utils._*`` or reads a
private attribute of a torch object (``tests/test_architecture.py`` holds it so), except the planner's
``Tracker``, a subclass of ``MemTracker`` that overrides its peak update (:data:`MEMTRACKER_PEAK_UPDATE`)."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["aot_eager_with_mode", "dynamo_reset", "FakeTensor", "FakeTensorMode", "forward_ad_active",
           "functorch_derivative_levels", "functorch_wrapped", "lookup_backend", "MEMTRACKER_PEAK_UPDATE",
           "MODULE_HOOK_TABLES", "patched_functorch_config", "pytree", "storage_key", "TorchDispatchMode",
           "unset_fake_temporarily"]

#: Every per-module hook table of ``nn.Module`` (the ``*_with_kwargs`` and ``always_called`` ones share the keys of
#: the hooks they qualify): moved with a replaced module, and cleaned when a hook is removed by hand.
MODULE_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                      "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
#: The method of ``torch.distributed._tools.mem_tracker.MemTracker`` the planner's Tracker overrides (stock walks
#: every module seen after each operation: quadratic in the blocks).
MEMTRACKER_PEAK_UPDATE = "_update_peak_stats"


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage (the C++ object's address: views and aliases share it; a fake tensor has one)."""
    return t.untyped_storage()._cdata


def functorch_wrapped(t) -> bool:
    """``t`` is a tensor wrapped by a torch.func transform (grad, vmap, jvp)."""
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)


def forward_ad_active() -> bool:
    """Forward-mode AD (``torch.autograd.forward_ad.dual_level``) is on."""
    return _forward_ad._current_level >= 0


def functorch_derivative_levels() -> int:
    """How many torch.func grad/jvp transforms are active (2 or more: a higher derivative is being taken)."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return sum(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters())


def dynamo_reset() -> None:
    """A fresh dynamo cache (a recompile limit would otherwise fall back to eager silently)."""
    torch._dynamo.reset()


def lookup_backend(name: str):
    """The ``torch.compile`` backend registered under ``name``."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(name)


def patched_functorch_config(**settings):
    """A context in which functorch's config holds ``settings`` (``activation_memory_budget``: the partitioner's
    knob, read when it runs)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(**settings)


def aot_eager_with_mode(gm, example_inputs, *, mode):
    """dynamo's ``aot_eager_decomp_partition_with_mode`` backend: the partitioned forward and backward graphs run
    op by op inside the dispatch ``mode``."""
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition_with_mode

    return aot_eager_decomp_partition_with_mode(gm, example_inputs, mode=mode)
