"""The norm rewrite of :func:`~.patch.patch_model`: a LayerNorm/RMSNorm whose readers (found by
:mod:`.norm_consumers`) allow it becomes an MS-norm, its affine merged into frozen consumers (eq. 58) or kept and
applied by wrapped trainable ones; every refusal is reported with its reason."""

from __future__ import annotations

import torch
from torch import nn

from . import swaps
from .common import (
    FILTERED,
    PatchConfig,
    PatchReport,
    RewriteGuard,
    Undo,
    by_pattern,
    move_hooks,
    replace,
)
from .discovery import Discovery, run_once
from .norm_consumers import find_readers
from .norm_forms import adopt_forms, norm_forms
from .norm_merge import (
    AffineInputLinear,
    NormInputLinear,
    _SharedOutput,
    consumer_features,
    consumer_wrappers,
    has_proven_norm_form,
    keep_affine,
    proven_form,
)

__all__ = ["replace_norms"]


def replace_norms(model: nn.Module, report: PatchReport, undo: Undo, example_input, savings: RewriteGuard,
                config: PatchConfig, discovery: Discovery | None = None) -> None:
    """Every norm whose readers allow it becomes an MS-norm (:func:`_rewrite_norm`), one pattern of paths at a time
    (:class:`~.common.RewriteGuard`); norms ``config.module_filter_fn`` refuses are left and reported. The readers
    are found by :func:`~.norm_consumers.find_readers` (once per kind of model with a ``discovery``)."""
    forms = run_once(norm_forms, model, example_input, discovery)  # probed once per kind of model
    adopt_forms(model, forms)
    modules = dict(model.named_modules())
    for name, why in forms.items():  # norm-like modules that compute no LayerNorm/RMSNorm form: said why
        if isinstance(why, str):
            report.skipped.append(f"{name} ({type(modules[name]).__name__}): {why}")
    found, why = run_once(find_readers, model, example_input, discovery)
    if found is None:
        report.skipped.append(f"norm merging: {why}; pass example_input to find consumers by running it")
        return
    for name, m in modules.items():  # proven norms that never ran (a BART decoder's cross-attention norm, run as a
        if name not in found and has_proven_norm_form(m):  # causal LM): nothing proves how their output is read
            report.skipped.append(f"{name}: not run on the example input (or not reached by tracing); left as it is")
    for name, (consumers, other) in found.items():  # rewritten by an earlier call: new readers must see α, β
        if swaps.merged(modules[name]) is not None:  # (correctness, never gated by the saving)
            _wrap_new_adapters(model, modules, name, consumers, other, report, undo)
        elif swaps.kept_affine(modules[name]):
            _wrap_new_consumers(model, modules, name, consumers, other, report, undo)
    new = [n for n in found if swaps.merged(modules[n]) is None and not swaps.kept_affine(modules[n])]
    for pattern, group in by_pattern(new):
        for names in savings.attempts(f"{pattern} (norms)", group):
            for name in names:
                if not config.wants(modules[name], name):
                    report.skipped.append(f"{name}: {FILTERED}")
                    continue
                _rewrite_norm(model, modules, name, *found[name], report, undo)


def _rewrite_norm(model, modules, name, consumers, other, report, undo) -> None:
    """One norm becomes a shared-output MS-norm: it returns the stock y = α⊙z + β (every reader, in any call, mode
    or wrapper added later, sees the stock value) with z attached, saves z and σ⁻¹ in place of its input, and its
    plain Linear consumers save that z in place of y (:class:`~.norm_merge.NormInputLinear`). Readers that are not
    plain Linears read y as they always did; at worst they keep it alive (less saving, never a wrong number)."""
    plain = [c for c in consumers if _plain_linear(modules[c])]
    readers = sorted(other) + [f"{c} (own forward)" for c in consumers if c not in plain]
    why = _why_not_rewritten(modules, name, plain)
    if why:
        report.skipped.append(f"{name}: {why}")
        return
    ms, wrapped = keep_affine(modules[name], [modules[c] for c in plain], shared_output=True)
    _install(model, modules, {name: ms, **dict(zip(plain, wrapped))}, undo)
    report.norms.append(f"{name} → {type(ms).__name__}: returns y by the stock forward, saves z and σ⁻¹ in place of "
                        f"its input" + (f"; {plain} save z in place of its output" if plain else "")
                        + (f"; {', '.join(readers)} read its output as stock" if readers else ""))


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear (or Hugging Face Conv1D) whose forward is the stock one: wrapping it changes only what it
    saves. A subclass with its own forward is left to read y (its forward would be dropped otherwise)."""
    kind = type(module)
    if kind.__name__ == "Conv1D":
        return True
    return isinstance(module, nn.Linear) and kind.forward is nn.Linear.forward


def _why_not_rewritten(modules: dict, name: str, consumers: list[str]) -> str | None:
    """Why the norm ``name`` may not become a shared-output MS-norm whose plain Linear ``consumers`` save z (None
    when it may). Other readers never stop it: they read the stock y."""
    norm = modules[name]
    dim = proven_form(norm).dim
    wrong = [c for c in consumers if consumer_features(modules[c])[0] != dim]
    if wrong:
        return f"consumer(s) {wrong} do not read its {dim} features as their input features"
    own = {p.dtype for p in norm.parameters()}  # QLoRA keeps norms in fp32 over a bf16 model: α⊙z is then fp32,
    theirs = {w.dtype for c in consumers  # which the consumers, computing α⊙z + β in z's dtype, would not be
              if isinstance(w := getattr(getattr(modules[c], "base_layer", modules[c]), "weight", None), torch.Tensor)}
    if own and theirs and not own <= theirs:
        return (f"its {'/'.join(sorted(str(d).removeprefix('torch.') for d in own))} weights promote what its "
                f"{'/'.join(sorted(str(d).removeprefix('torch.') for d in theirs))} readers get; rewritten, they "
                "would not (left as it is)")
    return None


def _install(model, modules, new: dict[str, nn.Module], undo) -> None:
    """Each module path of ``new`` gets its rewrite, with the replaced module's hooks (which see stock values)."""
    for path, module in new.items():
        move_hooks(modules[path], module)
        replace(model, modules, path, module, undo)


def _wrap_new_consumers(model, modules, name, consumers, other, report, undo) -> None:
    """Patch, then LoRA, then patch again: plain Linears that read the MS-norm's output since the first call (LoRA's
    adapters) save its z too, as the first call's consumers do. (A kept-affine norm of the older form, which returns
    z, wraps them only when nothing else reads it.)"""
    ms = modules[name]
    new = [c for c in consumers if not isinstance(modules[c], NormInputLinear) and _plain_linear(modules[c])]
    if not new:
        return
    if other and not isinstance(ms, _SharedOutput):
        report.skipped.append(f"{name}: {new} read it, but so does {sorted(other)}; left as they are")
        return
    _install(model, modules, dict(zip(new, consumer_wrappers(ms, [modules[c] for c in new]))), undo)
    report.norms.append(f"{name} (patched before): {new} now save its z in place of its output")


def _wrap_new_adapters(model, modules, name, consumers, other, report, undo) -> None:
    """Patch, then LoRA, then patch again: the adapters added since read the MS-norm's z; give them the norm's α, β
    (as LoRA-then-patch does), so that they see the input they would see in the unpatched model."""
    new = [c for c in consumers if _is_adapter(c) and not isinstance(modules[c], AffineInputLinear)]
    if not new:
        return
    if other:
        report.skipped.append(f"{name}: adapters {new} read it, but so does {sorted(other)}; left as they are")
        return
    norm = swaps.merged(modules[name])[0]
    _wrap_adapters(model, modules, norm, new, undo)
    report.norms.append(f"{name} (merged before): adapters {new} now apply its α, β to their input")


def _wrap_adapters(model, modules, norm, adapters, undo) -> None:
    """LoRA's lora_A: unchanged weight, reads z and applies the norm's α, β itself (AffineInputLinear)."""
    form = proven_form(norm)
    alpha = form.alpha(norm)
    alpha = torch.ones(form.dim) if alpha is None else alpha
    for c in adapters:
        wrapped = AffineInputLinear(modules[c], alpha, form.beta(norm))
        swaps.mark_replaced(wrapped, modules[c])
        replace(model, modules, c, wrapped, undo)


def _is_adapter(name: str) -> bool:
    """A LoRA adapter's down-projection (peft's ``…lora_A.<adapter>``): trainable, its weight must stay its own."""
    return "lora_A" in name.split(".")
