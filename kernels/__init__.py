"""Kernels: Triton modules generated from coefficient tables, autograd Functions and nn.Module drop-ins.

Reads tables; imports ``approximations``, never ``fitting``.
"""

from .codegen import export, triton_source
from .invact import InvActGELU, InvActivation, InvActSiLU, InvActSpec, invact
from .norms import MSLayerNorm, MSRMSNorm, merge_norm
from .patch import PatchReport, patch_model
from .relu_sum import ReGELU2, ReLUSumActivation, ReLUSumSpec, ReSiLU2, pack, relu_sum, unpack
from .saved import saved_bytes

__all__ = ["export", "triton_source", "ReGELU2", "ReLUSumActivation", "relu_sum", "ReLUSumSpec",
           "ReSiLU2", "pack", "unpack", "saved_bytes", "MSLayerNorm", "MSRMSNorm", "merge_norm",
           "invact", "InvActGELU", "InvActivation", "InvActSiLU", "InvActSpec",
           "PatchReport", "patch_model"]
