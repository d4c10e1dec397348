"""The norm rewrite of :func:`~.patch.patch_model`: a LayerNorm/RMSNorm whose readers (found by
:mod:`.norm_consumers`) allow it becomes an MS-norm, its affine merged into frozen consumers (eq. 58) or kept and
applied by wrapped trainable ones; every refusal is reported with its reason."""

from __future__ import annotations

import torch
from torch import nn

from . import swaps
from .norm_consumers import (
    RETURNED,
    consumers_by_dispatch,
    consumers_by_fx,
    data_dependent_branches,
    unproven_regions,
)
from .norm_forms import is_norm_candidate, norm_form
from .norm_merge import (
    AffineInputLinear,
    NormInputLinear,
    consumer_features,
    is_mergeable_norm,
    keep_affine,
    merge_norm,
    proven_form,
    refuse_stock_state_dicts,
)
from .rewrite import (
    FILTERED,
    HOOK_TABLES,
    PatchConfig,
    PatchReport,
    Savings,
    Undo,
    by_pattern,
    hooks_of,
    move_hooks,
    replace,
)


def merge_norms(model: nn.Module, report: PatchReport, undo: Undo, example_input, savings: Savings,
                config: PatchConfig) -> None:
    """Every norm whose readers allow it becomes an MS-norm (:func:`_rewrite_norm`), one pattern of paths at a time
    (:class:`~.rewrite.Savings`); norms ``config.module_filter_fn`` refuses are left and reported."""
    for name, m in model.named_modules():  # norm-like modules that compute no LayerNorm/RMSNorm form: said why
        if is_norm_candidate(m) and isinstance(why := norm_form(m), str):
            report.skipped.append(f"{name} ({type(m).__name__}): {why}")
    unproven: dict[str, str] = {}
    try:
        found, foreign = consumers_by_fx(model)
    except Exception as err:  # noqa: BLE001 - any tracing failure: fall back to running the model, or say why
        if example_input is None:
            report.skipped.append(f"norm merging: model is not fx-traceable ({type(err).__name__}: "
                                  f"{str(err)[:80]}); pass example_input to find consumers by running it")
            return
        found, foreign = consumers_by_dispatch(model, example_input)
        if branches := data_dependent_branches(model, example_input):  # proven block by block, then
            unproven = unproven_regions(model, example_input, found, branches)
    modules = dict(model.named_modules())
    shared = _shared_parameters(model)
    for name, m in modules.items():  # proven norms that never ran (a BART decoder's cross-attention norm, run as a
        if name not in found and is_mergeable_norm(m):  # causal LM): nothing proves how their output is read
            report.skipped.append(f"{name}: not run on the example input (or not reached by tracing); left as it is")
    for name, (consumers, other) in found.items():  # rewritten by an earlier call: new readers must see α, β
        if swaps.merged(modules[name]) is not None:  # (correctness, never gated by the saving)
            _wrap_new_adapters(model, modules, name, consumers, other, report, undo)
        elif swaps.kept_affine(modules[name]):
            _wrap_new_consumers(model, modules, name, consumers, other, report, undo)
    new = [n for n in found if swaps.merged(modules[n]) is None and not swaps.kept_affine(modules[n])]
    for pattern, group in by_pattern(new):
        with savings.group(f"{pattern} (norms)"):
            for name in group:
                if not config.wants(modules[name], name):
                    report.skipped.append(f"{name}: {FILTERED}")
                    continue
                _rewrite_norm(model, modules, name, *found[name], unproven, shared, foreign, report, undo)


def _rewrite_norm(model, modules, name, consumers, other, unproven, shared, foreign, report, undo) -> None:
    """One norm: MS-norm merged into its frozen consumers (eq. 58), or kept affine in wrapped trainable ones."""
    free = sorted(other) if consumers and other and all(map(_keeps_nothing, other)) else []
    ops_only = sorted(other) if not consumers and other and not any(map(_mutates, other)) else []
    why = unproven.get(name) or _why_not_rewritten(modules, name, consumers, set() if free else other,
                                                   ops_only=bool(ops_only))
    if why:
        report.skipped.append(f"{name}: {why}")
        return
    if free or ops_only or _trainable(modules[name], [modules[c] for c in consumers if not _is_adapter(c)]):
        ms, wrapped = keep_affine(modules[name], [modules[c] for c in consumers], shared_output=bool(free or ops_only))
        replace(model, modules, name, ms, undo)
        for c, w in zip(consumers, wrapped):
            move_hooks(modules[c], w)  # forward hooks see the same output (the others block: hooks)
            replace(model, modules, c, w, undo)
        made = f"{name} → {type(ms).__name__}"
        report.norms.append(
            f"{made}, saving z and σ⁻¹ in place of its input; its readers get α⊙z + β ({'; '.join(ops_only)})"
            if ops_only else f"{made}, α, β kept and applied by {consumers}"
            + (f"; {', '.join(free)} (keeping nothing for backward) read α⊙z + β" if free else ""))
        return
    why = _why_not_merged(modules, consumers, shared, foreign)
    if why:
        report.skipped.append(f"{name}: {why}")
        return
    adapters = [c for c in consumers if _is_adapter(c)]
    base = [c for c in consumers if c not in adapters]
    if not base:
        report.skipped.append(f"{name}: only adapter Linears ({adapters}) read it; nothing to merge into")
        return
    norm = modules[name]
    for c in base:
        undo.keep_linear(modules[c])
    ms = merge_norm(norm, [modules[c] for c in base])
    refuse_stock_state_dicts(model)
    replace(model, modules, name, ms, undo)
    _wrap_adapters(model, modules, norm, adapters, undo)
    report.norms.append(f"{name} → {type(ms).__name__} merged into {base}"
                        + (f"; adapters {adapters} apply its α, β to their input" if adapters else ""))


#: Ops that keep nothing of a norm's output for backward: a norm whose other readers are only these (or the model's
#: return: a hidden state) becomes a shared-output MS-norm (post-LN encoders' residual add, Swin's pad).
KEEPS_NOTHING = ("add", "sub", "constant_pad_nd")


def _keeps_nothing(reader: str) -> bool:
    """``reader`` (an entry of a norm's other readers: ``op`` or ``op in module``) is an op in :data:`KEEPS_NOTHING`,
    or the model's return (a shared-output MS-norm returns the stock value)."""
    return reader.split(" in ")[0] in KEEPS_NOTHING or reader == RETURNED


def _mutates(reader: str) -> bool:
    """``reader`` (an entry of a norm's other readers) writes into the norm's output: an in-place op (``add_``,
    ``index_put_``) or an item assignment. A norm that returns α⊙z + β must not see it written (z is saved)."""
    op = reader.split(" in ")[0]
    return op.endswith("_") or op == "setitem"


def _why_not_rewritten(modules: dict, name: str, consumers: list[str], other: set[str],
                       ops_only: bool = False) -> str | None:
    """Why the norm ``name`` may not become an MS-norm read by ``consumers`` (None when it may). ``ops_only``: no
    Linear reads it, only ops that do not write into it (``other``): it then saves z and σ⁻¹ in place of its input
    and returns α⊙z + β (a post-norm before a residual add, a QK-norm before RoPE)."""
    norm = modules[name]
    if not ops_only and (other or not consumers):
        mutating = sorted(filter(_mutates, other))
        return ("output feeds something other than Linear layers" + (f" ({', '.join(sorted(other))})" if other else "")
                + (f", and {', '.join(mutating)} write(s) into it" if mutating and not consumers else ""))
    if hooks := hooks_of(norm):
        return f"has {', '.join(hooks)}; rewritten, it would return z, so they would see another tensor"
    for c in consumers:
        if hooks := hooks_of(modules[c], HOOK_TABLES[1:]):
            return f"consumer {c} has {', '.join(hooks)}; they would see z, not the norm's output α⊙z + β"
    dim = proven_form(norm).dim
    wrong = [c for c in consumers if consumer_features(modules[c])[0] != dim]
    if wrong:
        return f"consumer(s) {wrong} do not read its {dim} features as their input features"
    own = {p.dtype for p in norm.parameters()}  # QLoRA keeps norms in fp32 over a bf16 model: α⊙z is then fp32,
    theirs = {w.dtype for c in consumers  # which a merged form, computing in the Linears' dtype, would not be
              if isinstance(w := getattr(getattr(modules[c], "base_layer", modules[c]), "weight", None), torch.Tensor)}
    if own and theirs and not own <= theirs:
        return (f"its {'/'.join(sorted(str(d).removeprefix('torch.') for d in own))} weights promote what its "
                f"{'/'.join(sorted(str(d).removeprefix('torch.') for d in theirs))} readers get; merged, they would "
                "not (left as it is)")
    return None


def _why_not_merged(modules: dict, consumers: list[str], shared: set[int], foreign: dict) -> str | None:
    """Why a frozen norm's affine may not be folded into its consumers' weights (eq. 58; None when it may)."""
    if any(type(modules[c]).__name__ == "Conv1D" for c in consumers):
        return "frozen, but a consumer is a Conv1D; merging folds into nn.Linear only"
    tied = [c for c in consumers if any(p.untyped_storage()._cdata in shared
                                        for p in modules[c].parameters(recurse=False))]
    if tied:
        return f"consumer(s) {tied} share their weight with another module (tied weights); merging would change " \
               "that module too"
    used = {c: sorted(foreign[c]) for c in consumers if c in foreign}
    if used:
        return f"consumer weights are also read outside the consumer ({used}); merging would change those uses too"
    return None


def _trainable(norm: nn.Module, consumers: list[nn.Module]) -> bool:
    """Merging α, β into W (eq. 58) is exact only when nothing of it trains (LoRA/QLoRA's frozen base): otherwise
    the optimiser would see W·diag α instead of W and α, and training would change."""
    return any(p.requires_grad for m in (norm, *consumers) for p in m.parameters())


def _wrap_new_consumers(model, modules, name, consumers, other, report, undo) -> None:
    """Patch, then LoRA, then patch again: Linears that read the MS-norm's z since the first call (LoRA's adapters)
    get its α, β too, so that they see the input they see in the stock model."""
    ms = modules[name]
    new = [c for c in consumers if not isinstance(modules[c], NormInputLinear)]
    if not new:
        return
    if other:
        report.skipped.append(f"{name}: {new} read it, but so does {sorted(other)}; left as they are")
        return
    for c in new:
        w = NormInputLinear(modules[c], ms)
        swaps.mark_replaced(w, modules[c])
        replace(model, modules, c, w, undo)
    report.norms.append(f"{name} (patched before): {new} now apply its α, β to their input")


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


def _shared_parameters(model: nn.Module) -> set[int]:
    """Storage pointers of parameters reachable under more than one name (tied weights)."""
    names: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        ptr = p.untyped_storage()._cdata
        names[ptr] = names.get(ptr, 0) + 1
    return {ptr for ptr, n in names.items() if n > 1}
