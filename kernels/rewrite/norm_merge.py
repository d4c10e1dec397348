"""Model surgery for the memory-sharing norms (Approx-BP App. G, eq. 58): merging a pretrained norm's affine (α, β)
into the Linears that consume it, keeping it beside LoRA adapters (``keep_affine``, with the adapter Linears that
read z), and undoing the merge. The norms themselves (kernels, twin, modules) are :mod:`approxbp.kernels.ops.norms`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..ops.norm_linear import AFFINE_OUT, NORM_INPUT_LINEAR, SAVES_Z_LINEAR, STOCK_OUT
from ..ops.norms import MSLayerNorm, MSRMSNorm
from . import swaps
from .norm_forms import NormForm, is_norm_candidate, norm_form

__all__ = ["AffineInputLinear", "attached_z", "consumer_features", "consumer_wrappers", "handoff",
           "has_proven_norm_form", "keep_affine", "merge_norm", "MSLayerNormSharedOutput", "MSRMSNormSharedOutput",
           "NormInputLinear", "proven_form", "refuse_stock_state_dicts", "unmerge_norm", "ZHandoff"]


class AffineInputLinear(nn.Linear):
    """A trainable adapter Linear (LoRA's ``lora_A``) that reads a merged norm's output z and computes
    Linear(α⊙z + β) = z·(W·diag α)ᵀ + (W·β + b), with the norm's frozen α, β as non-persistent buffers. Its weight,
    its gradient and its state-dict keys are those of the original Linear. It saves z itself (shared with the
    MS-norm) and the small r×d product W·diag α, never α⊙z + β; plain ops, so no Python in the backward and
    nothing for dynamo to break on."""

    def __init__(self, linear: nn.Linear, alpha: torch.Tensor, beta: torch.Tensor | None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: the optimiser sees no change
        self.register_buffer("alpha", alpha.detach().clone(), persistent=False)
        self.register_buffer("beta", None if beta is None else beta.detach().clone(), persistent=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.beta is None else self.weight @ self.beta.to(self.weight.dtype) + (
            0.0 if self.bias is None else self.bias)
        return nn.functional.linear(z, self.weight * self.alpha.to(self.weight.dtype), bias)


class ZHandoff:
    """How a shared-output MS-norm hands z to its consumer Linears, in the open: the norm holds one (``vars(norm)``
    under ``swaps.Z_HANDOFF``), records each y it returns with its z and y's version, and a consumer asks it for the
    z of the tensor it was given (:func:`attached_z`). An entry lives as long as y (a weak reference whose callback
    drops it, so z is held no longer than y is); a copy or a pickle of the norm starts empty."""

    def __init__(self):
        self._by_y: dict[int, tuple] = {}

    def give(self, y: torch.Tensor, z: torch.Tensor) -> None:
        entries, key = self._by_y, id(y)
        entries[key] = (weakref.ref(y, lambda _, k=key: entries.pop(k, None)), z, y._version)

    def z_for(self, y: torch.Tensor) -> torch.Tensor | None:
        """The z given with y (or with the tensor y views, as the same view of z when laid out alike), while that
        tensor is unchanged since; None for a tensor this norm did not return."""
        for base in (y, y._base):
            entry = self._by_y.get(id(base)) if base is not None else None
            if entry is not None and entry[0]() is base:
                break
        else:
            return None
        ref, z, version = entry
        if version != base._version:
            return None
        if base is y:
            return z
        if z.shape != base.shape or z.stride() != base.stride() or z.storage_offset() != base.storage_offset():
            return None
        return z.as_strided(y.size(), y.stride(), y.storage_offset())

    def __deepcopy__(self, memo):
        return ZHandoff()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self._by_y = {}


def handoff(norm: nn.Module) -> ZHandoff:
    """The shared-output norm's :class:`ZHandoff` (made on first use)."""
    return norm.__dict__.setdefault(swaps.Z_HANDOFF, ZHandoff())


def attached_z(y: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
    """The z that the shared-output MS-norm ``norm`` returned y with, while y is unchanged since (None otherwise:
    another norm's output, as when layer drop skips a block and a consumer gets an earlier norm's y). For a view
    of y (a classifier reading the first token, ``y[:, 0]``) the same view of z, when y and z are laid out
    alike."""
    found = norm.__dict__.get(swaps.Z_HANDOFF)
    return found.z_for(y) if found is not None else None


class _SharedOutput:
    """An MS-norm whose output also feeds ops that keep nothing for backward (post-LN encoders: the residual add of
    the next sub-layer): it returns y by the replaced module's own forward (``norm_linear.STOCK_OUT``: the stock
    value bit for bit, with the gradient of α⊙z + β), handing z to its :class:`ZHandoff`, so that its consumer Linears
    (:class:`NormInputLinear`) read y and save z while the add reads y. z stays in the input's dtype (the add
    needs the stock precision under autocast). Compiled (dynamo), the stock module's own forward runs: the
    partitioner already saves the norm's input and statistics and recomputes y for its readers (one tensor per
    norm, the MS-norm's saving), and under autocast it may keep a bf16 y where z would be fp32 (docs/training.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stock = swaps.replaced(self)  # (None: a norm built by hand; an exported program keeps the MS-norm's ops)
        if stock is not None and torch.compiler.is_compiling() and not torch.compiler.is_exporting():
            return type(stock).forward(stock, x)  # its Parameters are this module's (keep_affine)
        z = self.normalise(x, None)
        alpha, beta = self.norm_form.alpha(self), self.norm_form.beta(self)
        if stock is not None and not torch.compiler.is_exporting():  # y: the stock norm's own value
            y = STOCK_OUT(z, alpha, beta, x, getattr(self, "weight", None), stock)
        elif alpha is not None or beta is not None:  # (no stock module: a norm built by hand, or an export)
            y = AFFINE_OUT(z, alpha, beta)
        else:
            y = z.view_as(z)
        if not torch.compiler.is_compiling():  # (a norm with no stock module to run: its consumers read y as stock)
            handoff(self).give(y, z)
        return y


class MSLayerNormSharedOutput(_SharedOutput, MSLayerNorm):
    """:class:`MSLayerNorm` returning α⊙z + β with z attached (:class:`_SharedOutput`)."""


class MSRMSNormSharedOutput(_SharedOutput, MSRMSNorm):
    """:class:`MSRMSNorm` returning α⊙z + β with z attached (:class:`_SharedOutput`)."""


class NormInputLinear(nn.Linear):
    """A consumer Linear (or Hugging Face ``Conv1D``) of a norm whose affine α, β stay the model's own parameters:
    it reads the MS-norm's z and computes Linear(α⊙z + β) exactly, saving only z (shared with the MS-norm).
    Weight, bias and their state-dict keys are the original module's; α, β are read from the norm at every call,
    so they train as in the stock model (``norm_linear.NORM_INPUT_LINEAR``)."""

    def __init__(self, linear: nn.Module, norm: nn.Module):
        nn.Module.__init__(self)
        self.transposed = type(linear).__name__ == "Conv1D"  # weight (in, out): y = x·W + b
        self.in_features, self.out_features = consumer_features(linear)
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: the optimiser sees no change
        self.__dict__["norm"] = norm  # not a submodule: α, β keep their own (single) state-dict keys

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        norm = self.__dict__["norm"]
        weight = self.weight.t() if self.transposed else self.weight
        form = norm.__dict__.get("norm_form", _AFFINE)  # α = w, or Gemma's 1 + w (its gradient still reaches w)
        if isinstance(norm, _SharedOutput):  # it reads y: z is attached to it (else y is read as stock)
            found = None if torch.compiler.is_compiling() else attached_z(z, norm)
            if found is None:
                return nn.functional.linear(z, weight, self.bias)
            return SAVES_Z_LINEAR(z, found.detach(), weight, self.bias, form.alpha(norm), form.beta(norm))
        return NORM_INPUT_LINEAR(z, weight, self.bias, form.alpha(norm), form.beta(norm))

    def extra_repr(self) -> str:
        return super().extra_repr() + (", Conv1D" if self.transposed else "") + ", input α⊙z + β"


def proven_form(norm: nn.Module) -> NormForm:
    """The norm's proven :class:`NormForm`, or a TypeError saying why it has none."""
    form = norm_form(norm) if is_norm_candidate(norm) else f"{type(norm).__name__} is not a norm module"
    if isinstance(form, str):
        raise TypeError(f"{type(norm).__name__} cannot become an MS-norm: {form}")
    return form


#: α = w, β = b: the form of MS-norms made before forms were recorded (a pickled 0.1 model).
_AFFINE = NormForm(0, None, True, 0.0)


def consumer_features(linear: nn.Module) -> tuple[int, int]:
    """(in, out) features of a consumer: nn.Linear, or Hugging Face's Conv1D, whose weight is stored (in, out)."""
    w = linear.weight
    return (w.shape[0], w.shape[1]) if type(linear).__name__ == "Conv1D" else (linear.in_features, linear.out_features)


def _ms_norm_of(form: NormForm, shared_output: bool = False) -> MSLayerNorm:
    kinds = (MSLayerNormSharedOutput, MSRMSNormSharedOutput) if shared_output else (MSLayerNorm, MSRMSNorm)
    ms = kinds[0 if form.center else 1](form.dim, form.eps)
    ms.norm_form = form  # the form whose α, β NormInputLinear applies (kept affine: the same Parameters)
    return ms


def consumer_wrappers(ms: nn.Module, consumers: list[nn.Module]) -> list[NormInputLinear]:
    """Each consumer of the kept-affine MS-norm ``ms`` as a :class:`NormInputLinear` (marked for unpatch)."""
    dim = ms.norm_form.dim
    wrapped = [NormInputLinear(c, ms) for c in consumers]
    for c, w in zip(consumers, wrapped):
        if w.in_features != dim:
            raise ValueError(f"consumer {c} must read {dim} features")
        swaps.mark_replaced(w, c)
    return wrapped


def keep_affine(norm: nn.Module, consumers: list[nn.Module],
                shared_output: bool = False) -> tuple[MSLayerNorm, list[NormInputLinear]]:
    """The non-reparameterising MS-norm (the default for trainable models): the norm becomes an MS-norm that
    returns z and holds the norm's own ``weight`` and ``bias`` Parameters under their stock names, and every
    consumer becomes a :class:`NormInputLinear` that applies α = offset + w and β = b (the norm's proven form).
    The function computed, every gradient and the state dict are the stock model's; z is saved once for the norm
    and all its consumers. ``shared_output``: the norm's output also feeds ops that keep nothing for backward, so it
    returns y = α⊙z + β with z attached (:class:`_SharedOutput`)."""
    form = proven_form(norm)
    ms = _ms_norm_of(form, shared_output)
    wrapped = consumer_wrappers(ms, consumers)
    ms.weight = getattr(norm, "weight", None)  # Parameters (or None): the same objects, the same state-dict keys
    if hasattr(norm, "bias"):
        ms.bias = norm.bias
    swaps.mark_replaced(ms, norm)  # for unpatch: no arithmetic to undo
    swaps.mark_kept_affine(ms)
    return ms, wrapped


def has_proven_norm_form(module: nn.Module) -> bool:
    """Whether ``module`` is proven to compute a LayerNorm/RMSNorm form (:func:`.norm_forms.norm_form`)."""
    return is_norm_candidate(module) and not isinstance(norm_form(module), str)


@torch.no_grad()
def merge_norm(norm: nn.Module, consumers: list[nn.Linear]) -> MSLayerNorm:
    """Fold the norm's affine into every consumer Linear in place (eq. 58) and return the MS-norm that
    replaces it. Several consumers (e.g. q, k, v) all get merged; the function computed is unchanged.
    Accepts any module proven to compute a LayerNorm/RMSNorm form (:func:`.norm_forms.norm_form`)."""
    if not consumers:
        raise ValueError("merge_norm needs at least one consumer nn.Linear")
    form = proven_form(norm)
    dim = form.dim
    for lin in consumers:
        if not isinstance(lin, nn.Linear) or lin.in_features != dim:
            raise ValueError(f"consumer {lin} must be an nn.Linear with in_features={dim}")
    alpha = form.alpha(norm)
    alpha = torch.ones(dim) if alpha is None else alpha
    beta = form.beta(norm)
    merged = []  # everything is computed before anything is written: an error leaves the consumers untouched
    for lin in consumers:
        W = lin.weight.double()
        b = lin.bias.double() if lin.bias is not None else torch.zeros(lin.out_features, dtype=torch.float64)
        if beta is not None:
            b = b + W @ beta.to(W.device, torch.float64)
        merged.append((lin, (W * alpha.to(W.device, torch.float64)).to(lin.weight.dtype),
                       b.to(lin.weight.dtype) if (beta is not None or lin.bias is not None) else None))
    created = [lin.bias is None and b is not None for lin, _, b in merged]
    for lin, W, b in merged:
        lin.weight.copy_(W)
        if b is not None and lin.bias is None:
            lin.bias = nn.Parameter(b, requires_grad=lin.weight.requires_grad)
        elif b is not None:
            lin.bias.copy_(b.to(lin.bias.dtype))
    ms = _ms_norm_of(form)
    # what unmerge_norm needs (kept outside the module tree: no parameters, no state-dict keys)
    swaps.mark_merged(ms, norm, [m for m, _, _ in merged], created)
    ms._register_state_dict_hook(_warn_merged_layout)
    if not any(p.requires_grad for lin, _, _ in merged for p in lin.parameters(recurse=False)):
        ms.register_forward_pre_hook(_refuse_training_merged_consumers)  # frozen now: must stay frozen
    return ms


def _refuse_training_merged_consumers(ms: nn.Module, args) -> None:
    """Merging frozen consumers is exact only while they stay frozen: unfrozen after it (``requires_grad_(True)``
    for full fine-tuning) they would train W·diag α in place of W and α. Refused in every forward that records a
    graph. (Consumers that were trainable when merged were merged on purpose, by a direct call: left alone.)"""
    if not torch.is_grad_enabled():
        return
    norm, consumers, _ = swaps.merged(ms)
    if any(p.requires_grad for c in consumers for p in c.parameters(recurse=False)):
        raise RuntimeError(f"{type(norm).__name__} is merged into frozen consumers (eq. 58), which now require grad: "
                           "training would optimise W·diag α instead of W and α. unpatch(model) before unfreezing "
                           "it, then patch_model again (trainable models keep the norm's α, β)")


def refuse_stock_state_dicts(model: nn.Module) -> None:
    """Make ``model.load_state_dict`` refuse a stock-layout state dict (one holding a merged norm's weight) before it
    loads anything: its consumer weights are unscaled, and ``strict=False`` would load them into merged consumers
    without a word. Registered once per model; it checks the norms merged at load time."""
    if model.__dict__.get(swaps.REFUSES_STOCK_LAYOUT):
        return
    model.__dict__[swaps.REFUSES_STOCK_LAYOUT] = True
    model.register_load_state_dict_pre_hook(_refuse_stock_layout)


def _refuse_stock_layout(module, state_dict, prefix, *args) -> None:
    for name, m in module.named_modules():
        record = swaps.merged(m)
        if record is None:
            continue
        keys = [f"{prefix}{name}.{k}" for k, _ in record[0].named_parameters(recurse=False)]
        if any(k in state_dict for k in keys):
            raise RuntimeError(f"this state dict has the stock layout ({keys[0]} is there), but {name or 'a norm'} "
                               "is merged into its consumers, whose weights are scaled (eq. 58): load it into the "
                               "stock model, or unpatch(model), load, and patch_model again")


def _warn_merged_layout(module, state_dict, prefix, local_metadata) -> None:
    """Saving a model whose norms are merged gives a state dict the stock class cannot load as it was trained. One
    text for every norm (no module path), so Python's default filter shows it once, not once per merged norm (peft's
    ``save_pretrained`` reads the whole state dict and keeps the adapters, which are unaffected)."""
    import warnings

    warnings.warn("norms are merged into their frozen consumers (eq. 58): this model's state dict is not the stock "
                  "layout (norm weights missing, consumer weights scaled); save "
                  "approxbp.kernels.patched_state_dict(model), or unpatch(model) first. Adapter-only saves (peft's "
                  "save_pretrained) are unaffected", UserWarning, stacklevel=3)


@torch.no_grad()
def unmerge_norm(ms: MSLayerNorm) -> nn.Module:
    """Undo :func:`merge_norm`: W = W̃·diag(α)⁻¹ and b = b̃ − W·β in every consumer (float64), and return the
    original norm module. Raises if α has zeros (the merged columns carry no information then)."""
    if swaps.merged(ms) is None:
        raise ValueError(f"{ms} was not made by merge_norm")
    norm, consumers, created = swaps.merged(ms)
    alpha = proven_form(norm).alpha(norm)
    alpha = None if alpha is None else alpha.double()
    if alpha is not None and bool((alpha == 0).any()):
        raise ValueError("cannot unmerge: the norm's weight α has zeros")
    beta = getattr(norm, "bias", None)
    for lin, made in zip(consumers, created):
        W = lin.weight.double() / (alpha.to(lin.weight.device) if alpha is not None else 1.0)
        if made:
            lin.bias = None
        elif lin.bias is not None and beta is not None:
            lin.bias.copy_((lin.bias.double() - W @ beta.double().to(W.device)).to(lin.bias.dtype))
        lin.weight.copy_(W.to(lin.weight.dtype))
    weight = consumers[0].weight  # the model was moved or cast since the merge (.to(device), .half()): so is the norm
    cast = weight.dtype if weight.dtype != swaps.merged_dtype(ms) else None
    return norm.to(device=weight.device, dtype=cast)
