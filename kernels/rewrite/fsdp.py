"""FSDP2 after the fact: ``fully_shard`` records, for each Parameter it shards, the modules that hold it
(``ParamModuleInfo``: the module, and any module sharing it), and swaps the sharded and the gathered tensor in and
out of exactly those around each forward and backward. A rewrite made after sharding holds the same Parameter in a
module of its own (an MS-norm holds the norm's weight, a consumer its Linear's), which FSDP2 would never update: it
would compute with the sharded DTensor ("mixed torch.Tensor and DTensor"). :func:`share_with_fsdp` adds each such
(module, name) to the Parameter's record, as FSDP2 does itself for a Parameter shared when it shards.

FSDP2's records are private (``torch.distributed.fsdp._fully_shard``): this is the one place that reads them, and
``tests/kernels/test_modes.py`` trains a model patched after ``fully_shard`` to stock's gradients on each torch
this project supports; a torch whose FSDP2 lacks them is refused here by name rather than trained wrongly."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["share_with_fsdp", "sharded_by_fsdp"]


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` sharded ([] when FSDP2 was never imported: nothing
    sharded the model, and importing it would pull sympy into the run time)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FSDPModule"):
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def sharded_by_fsdp(model: nn.Module) -> bool:
    """``model`` holds modules sharded by FSDP2: running any of them runs FSDP2's hooks (tracing one with torch.fx
    would make it FSDP2's root, which a later forward of the real root then refuses)."""
    return bool(_fsdp_modules(model))


def share_with_fsdp(model: nn.Module) -> int:
    """Register every module of ``model`` that holds a Parameter FSDP2 sharded, but is not in that Parameter's
    record, as one more holder FSDP2 swaps it in and out of. Returns how many were added (0 without FSDP2)."""
    records = {}
    for m in _fsdp_modules(model):
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            info = getattr(param, "_module_info", None)
            if info is None or not hasattr(info, "shared_modules"):
                raise RuntimeError("this torch's FSDP2 keeps no ParamModuleInfo, which approxbp extends to the "
                                   "modules its rewrites add: patch the model before fully_shard")
            held = info.module._parameters.get(info.param_name)  # sharded, or gathered since a root forward
            records.update({id(param.sharded_param): info, **({id(held): info} if held is not None else {})})
    added = 0
    for module in model.modules() if records else ():
        for name, p in module._parameters.items():
            info = records.get(id(p))
            if info is None:
                continue
            holders = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
            if not any(m is module and n == name for m, n in holders):
                info.shared_modules.append(module)
                info.shared_param_names.append(name)
                added += 1
    return added
