"""Kernels: Triton modules generated from coefficient tables, custom ops and nn.Module drop-ins.

Reads tables and the modules ``approxbp export`` generated from them; imports ``approximations`` (sympy-free
parts: ``tables``, ``backends``, ``bdia``), never ``fitting``, and never the code generator (``codegen``, the build
side) or sympy at run time.
"""

from . import invact, relu_sum  # the modules (their functions: relu_sum.relu_sum, invact.invact)
from .invact import InvActGELU, InvActivation, InvActSiLU, InvActSpec
from .norm_merge import merge_norm
from .norms import MSLayerNorm, MSRMSNorm
from .patch import PatchReport, patch_model, patched_state_dict, unpatch
from .relu_sum import ReGELU2, ReLUSumActivation, ReLUSumSpec, ReSiLU2
from .saved import saved_bytes

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
