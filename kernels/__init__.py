"""Kernels: Triton modules generated from coefficient tables, custom ops and nn.Module drop-ins.

Three rooms, each importing only downward: ``rewrite`` (model rewriting: ``patch_model``) → ``ops`` (the run time:
custom ops, autograd Functions, drop-ins) → ``generated`` (the modules ``approxbp export`` writes, their shared
Triton helpers included); the build side ``codegen`` (sympy → Triton) writes ``generated`` and reads ``ops``' specs,
and nothing at run time imports it. Imports ``approximations`` (sympy-free parts), never ``fitting``.
"""

from .ops.invact import InvActGELU, InvActivation, InvActSiLU, InvActSpec, invact
from .ops.norms import MSLayerNorm, MSRMSNorm
from .ops.relu_sum import ReGELU2, ReLUSumActivation, ReLUSumSpec, ReSiLU2, relu_sum
from .ops.saved import saved_bytes
from .rewrite.norm_merge import merge_norm
from .rewrite.patch import PatchReport, patch_model, patched_state_dict, unpatch


def __getattr__(name):
    """``export`` and ``triton_source`` are the build side (kernels.codegen, which imports sympy): imported when
    asked for, never by the run time."""
    if name in ("export", "triton_source"):
        from . import codegen

        return getattr(codegen, name)
    raise AttributeError(f"module 'approxbp.kernels' has no attribute {name!r}")


__all__ = ["export", "triton_source", "ReGELU2", "ReLUSumActivation", "relu_sum", "ReLUSumSpec",
           "ReSiLU2", "saved_bytes", "MSLayerNorm", "MSRMSNorm", "merge_norm",
           "invact", "InvActGELU", "InvActivation", "InvActSiLU", "InvActSpec",
           "PatchReport", "patch_model", "unpatch", "patched_state_dict"]
