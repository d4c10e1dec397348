"""patch_model: swap activations for their memory-saving versions, fuse gated MLPs into the exact GLU op and make
norms MS-norms; every rewrite returns the stock value, is proven on the example input (or skipped with its reason,
alone), and everything is undone on an error. The rewrites live in :mod:`.activation_swap`, :mod:`.glu_patch` and
:mod:`.norm_patch`; what they share (report, undo log, example runs, the saved-bytes check) in :mod:`.rewrite`."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from approxbp.approximations.deprecated import warn_renamed
from torch import nn

from . import functional_swap, swaps
from .activation_swap import ACTIVATION_CLASSES, ACTIVATION_LIKE, OURS, class_key, swap_activations
from .glu import GatedMLP
from .glu_patch import fuse_gated_mlps
from .moe_patch import fuse_expert_gates
from .norm_merge import unmerge_norm
from .norm_patch import merge_norms
from .plan_file import plan_config
from .rewrite import (
    PATCH_FAMILIES,
    PatchConfig,
    PatchReport,
    Savings,
    Undo,
    every_output,
    is_table,
    output_difference,
    path_pattern,
    run_example,
)

__all__ = ["patch_model", "unpatch", "patched_state_dict", "PatchConfig", "PatchReport", "ACTIVATION_CLASSES",
           "ACTIVATION_LIKE", "OURS", "PATCH_FAMILIES", "class_key", "every_output", "path_pattern"]

#: patch_model's positional parameters in 0.1, in order (each still accepted, with a DeprecationWarning).
_POSITIONAL_0_1 = ("activation", "norm", "example_input", "bits", "plan", "check", "glu")


def patch_model(model: nn.Module, *args, family: str | None = "relu-sum", tables=None, module_filter_fn=None,
                norms: bool = True, example_input=None, check: bool = True, bits: int = 2, glu=True,
                config: PatchConfig | None = None, **old) -> PatchReport:
    """In place: replace every activation in :data:`ACTIVATION_CLASSES` (nn.GELU both ways, nn.SiLU, nn.Mish,
    nn.Softplus and the Hugging Face GELU/NewGELU/FastGELU/QuickGELU/SiLU/Mish classes) by its drop-in, fuse gated
    MLPs and make norms MS-norms, as :class:`~.rewrite.PatchConfig` describes (``family``, ``tables``, ``norms``,
    ``glu``, ``bits``, ``module_filter_fn``: keyword arguments of the same names, or ``config=``).

    Every rewrite changes what is saved for backward, never what a reader sees. Norms: a LayerNorm/RMSNorm (found by
    what it computes) becomes a shared-output MS-norm that returns the stock α⊙z + β with z attached; its plain
    Linear consumers (found with torch.fx, or for models fx cannot trace by one run of ``example_input`` — a tensor,
    a tuple of positional arguments or a dict of keyword arguments — under a dispatch mode that sees every op
    reading the norm's output) save z in place of y; every other reader reads y as stock. Gated MLPs (with an
    example input) become :class:`~.glu.GatedMLP` (saves g and u, no gradient error) once a float64 probe proves it.

    With ``example_input`` each group of rewrites is run against the stock outputs (eval and train mode) and its
    saved bytes measured: a group that changes an output is retried module by module and the module that cannot be
    proven is undone and reported; a group that saves nothing is undone and reported. ``check=False`` skips both
    (the planner patches fake tensors). On an error every change made so far is undone before it propagates.

    0.1's arguments still work, with a DeprecationWarning: ``activation`` (a family, a table path or a mapping:
    ``family``/``tables``), ``norm`` (``norms``), ``plan`` (``approxbp.plan.Plan.load(path).apply(model)``), and
    positional ones after ``model``."""
    if config is None:
        config, example_input, check = _config(model, args, old, dict(
            family=family, tables=tables, module_filter_fn=module_filter_fn, norms=norms, bits=bits, glu=glu),
            example_input, check)
    elif args or old:
        raise TypeError("patch_model(model, config=…) takes no other rewrite arguments")
    report, undo = PatchReport(), Undo()
    before = run_example(model, example_input) if check else None
    try:
        savings = Savings(model, example_input, report, undo, measure=check, stock=before)
        if config.norms:
            merge_norms(model, report, undo, example_input, savings, config)
        functional = {}
        if example_input is not None and (config.glu or config.family is not None or config.tables is not None):
            functional = fuse_gated_mlps(model, report, undo, example_input, config, savings)
            if config.glu:
                fuse_expert_gates(model, report, undo, config, savings)
        elif not isinstance(config.glu, bool):  # named gated MLPs (a plan's) are reported, never silently left
            report.skipped += [f"{p}: listed in glu=, not fused: a gated MLP is fused only once an example input "
                               "proves it (pass example_input=…)" for p in sorted(config.glu)]
        if config.family is not None or config.tables is not None:
            swap_activations(model, report, undo, config, savings, functional)
        savings.close()
        if before is not None:
            report.max_output_difference = _compare_outputs(before, run_example(model, example_input))
    except BaseException:
        undo.rollback()
        raise
    return report


def _config(model, args: tuple, old: dict, new: dict, example_input, check) -> tuple[PatchConfig, object, bool]:
    """The :class:`PatchConfig` (and example input, check) of a call, 0.1's arguments translated with a warning."""
    if len(args) > len(_POSITIONAL_0_1):
        raise TypeError(f"patch_model takes at most {len(_POSITIONAL_0_1)} positional arguments after model (0.1's)")
    if unknown := set(old) - {"activation", "norm", "plan"}:
        raise TypeError(f"patch_model got unexpected keyword arguments {sorted(unknown)}")
    if args:
        warn_renamed("patch_model's positional arguments after model", "keyword arguments (family=, tables=, "
                     "norms=, example_input=, check=, …)", stacklevel=4)
        old = {**dict(zip(_POSITIONAL_0_1, args)), **old}
    example_input = old.pop("example_input", example_input)
    check = old.pop("check", check)
    config = PatchConfig(**{**new, **{k: old.pop(k) for k in ("bits", "glu") if k in old}})
    if "norm" in old:
        warn_renamed("patch_model(norm=…)", "patch_model(norms=…)", stacklevel=4)
        config = replace(config, norms=old.pop("norm"))
    if "activation" in old:
        warn_renamed("patch_model(activation=…)", "patch_model(family=…) or patch_model(tables=…)", stacklevel=4)
        activation = old.pop("activation")
        if activation in PATCH_FAMILIES or activation is None:
            config = replace(config, family=activation)
        elif isinstance(activation, dict) or is_table(activation):
            config = replace(config, family=None, tables=activation)
        else:
            raise ValueError(f"activation must be one of {(*PATCH_FAMILIES, None)}, a table path or a mapping, got "
                             f"{activation!r}")
    if old.get("plan") is not None:
        warn_renamed("patch_model(plan=…)", "approxbp.plan.Plan.load(path).apply(model)", stacklevel=4)
        return plan_config(old["plan"], model), example_input, check
    return config, example_input, check


def _compare_outputs(before: list, after: list) -> float:
    """The largest difference between the stock and the patched model's outputs (:func:`~.rewrite.run_example`).
    Each group of rewrites was already proven (:class:`~.rewrite.Savings`), so a difference here is a bug: it
    raises, and patch_model undoes everything."""
    largest, why = output_difference(before, after)
    if why:
        raise RuntimeError(f"patching changed {why} on the example input; the model is restored")
    return largest


@torch.no_grad()
def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` in place: every drop-in goes back to the module it replaced and every MS-norm is
    unmerged (consumer weights and biases restored, the original norm back in place). Returns the model."""
    for _, parent in reversed(list(model.named_modules())):  # children first: a GatedMLP hands back restored ones
        functional_swap.uninstall(parent)
        swaps.remove_expert_gate(parent)
        for child_name, child in list(parent.named_children()):
            if isinstance(child, GatedMLP):
                swaps.replaced(child)._modules.update(child._modules)  # adapters added since stay
            if swaps.replaced(child) is not None:
                setattr(parent, child_name, swaps.replaced(child))
            elif swaps.merged(child) is not None:
                setattr(parent, child_name, unmerge_norm(child))
    return model


def patched_state_dict(model: nn.Module) -> dict:
    """The state dict of the stock architecture (norm weights back, consumers unmerged) for a patched model,
    which stays patched: ``Stock(...).load_state_dict(patched_state_dict(model))`` gives the same outputs."""
    return unpatch(copy.deepcopy(model)).state_dict()
