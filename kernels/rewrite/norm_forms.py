"""Norms recognised by what they compute, not by their class name: a float64 probe proves that a module's forward
is one of the forms the MS-norms replace (Approx-BP §5.2, eq. 17),

    y = α ⊙ ẑ + β over the last dimension,  ẑ = (x − μ)/√(σ² + ε)  (LayerNorm)  or  x/√(mean(x²) + ε)  (RMSNorm),

with α = w (LayerNorm, Llama's RMSNorm, T5's), α = 1 + w (Gemma's RMSNorm, Nemotron's LayerNorm1P) or α = 1 (no
weight: OLMo's LayerNorm), and β = b or 0. The probe runs a shallow copy of the module whose parameters are real
random float64 vectors (so α = w and α = 1 + w differ, and a fake-tensor model can be probed), on rows of several
scales, and compares with each form to 1e-5 (modules that compute in float32 inside reach about 1e-7).
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from . import swaps

__all__ = ["adopt_forms", "is_norm_candidate", "norm_form", "norm_forms", "NormForm"]


#: The scales of the probe's rows: eps matters at the small ones (a variance of 1e-12, 1e-6).
_PROBE_SCALES = (1e-6, 1e-3, 1.0, 1e3)
#: eps values tried when a module has no ``eps``/``variance_epsilon`` attribute (OLMo writes 1e-5 in its forward).
_DEFAULT_EPS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-7)
#: How close the module's output must come to a form (relative to max(1, |y|)).
_PROBE_TOLERANCE = 1e-5
_FORM = swaps.NORM_FORM


@dataclass(frozen=True)
class NormForm:
    """What a norm module computes (see the module docstring); α and β are read from the module at each use."""

    dim: int
    eps: float | None  # None: the input dtype's machine epsilon (nn.RMSNorm(eps=None))
    center: bool  # LayerNorm (μ removed) or RMSNorm
    offset: float  # α = offset + w: 0 (α = w) or 1 (α = 1 + w); with no weight, α = 1

    def alpha(self, norm: nn.Module) -> torch.Tensor | None:
        """α as a tensor on the weight's graph (so its gradient reaches w), or None when α = 1."""
        w = getattr(norm, "weight", None)
        if w is None:
            return None
        return w if self.offset == 0 else w + self.offset

    @staticmethod
    def beta(norm: nn.Module) -> torch.Tensor | None:
        return getattr(norm, "bias", None)

def is_norm_candidate(module: nn.Module) -> bool:
    """A leaf module whose class says it normalises (``…Norm…``) or whose attributes do (an ``eps`` beside a vector
    ``weight``), or a torch LayerNorm/RMSNorm; approxbp's own MS-norms and Linears (``NormInputLinear``) are not."""
    from ..ops.norms import MSLayerNorm

    if isinstance(module, MSLayerNorm | nn.Linear) or next(module.children(), None) is not None:
        return False
    weight = getattr(module, "weight", None)
    looks = any(hasattr(module, a) for a in ("eps", "variance_epsilon")) and isinstance(weight, torch.Tensor) and (
        weight.dim() == 1)
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or "norm" in type(module).__name__.lower() or looks


def norm_form(module: nn.Module) -> NormForm | str:
    """The proven :class:`NormForm` of ``module``, or why none is (a plain reason for the report). Cached on the
    module (the form is structural; α, β are read at each use)."""
    cached = module.__dict__.get(_FORM)
    if cached is None:
        cached = module.__dict__[_FORM] = _probe(module)
    return cached


def norm_forms(model: nn.Module, example_input=None) -> dict[str, NormForm | str]:
    """{path: :func:`norm_form`} of every norm candidate of ``model`` (``example_input`` unused: a finder for
    :func:`~.discovery.run_once`, so that the planner, which builds the same model for every step it measures, probes
    each norm once per request)."""
    return {name: norm_form(m) for name, m in model.named_modules() if is_norm_candidate(m)}


def adopt_forms(model: nn.Module, forms: dict[str, NormForm | str]) -> None:
    """Each module named in ``forms`` takes its form as :func:`norm_forms` found it on a build of the same model
    (:func:`norm_form`'s cache; a module that has one keeps it)."""
    modules = dict(model.named_modules())
    for name, form in forms.items():
        modules[name].__dict__.setdefault(_FORM, form)


def _extra_inputs(module: nn.Module) -> list[str]:
    """The forward's parameters beyond its input (a gated norm's ``gate``): a call that passes one computes another
    function than the one probed."""
    import inspect

    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in list(signature.parameters.items())[1:] if p.kind in kinds]


def _probe(module: nn.Module) -> NormForm | str:
    if extra := _extra_inputs(module):
        return (f"its forward takes {', '.join(extra)} beside the input (a gated norm: norm(x, gate) is not "
                "α⊙z + β of x alone); left as it is")
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"}:
        return f"parameters {sorted(params)}: a norm the MS-norms replace has at most weight and bias"
    shape = getattr(module, "normalized_shape", None)
    shape = (shape,) if isinstance(shape, int) else tuple(shape) if shape is not None else None
    if shape is not None and len(shape) != 1:
        return f"normalises over {shape}, not the last dimension alone"
    if any(p.dim() != 1 for p in params.values()):
        return "normalises over several dimensions (its weight is not a vector)"
    dims = {p.shape[0] for p in params.values()} | ({shape[0]} if shape else set())
    if len(dims) != 1:
        return "no single feature size to read from its weight, bias or normalized_shape"
    dim = dims.pop()
    eps_attr = next((a for a in ("eps", "variance_epsilon", "epsilon") if hasattr(module, a)), None)
    eps_values = (getattr(module, eps_attr),) if eps_attr else _DEFAULT_EPS
    if not all(e is None or isinstance(e, float | int) for e in eps_values):
        return f"its {eps_attr} is not a number"
    from approxbp.kernels.ops.torch_private import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        try:
            probe, x, y = _probe_run(module, dim)
            probe.training = not module.training  # the other mode: the form must hold in both (a module patched in
            other = probe.forward(x)              # eval mode is trained next)
        except Exception as err:  # noqa: BLE001 - what cannot be probed is not rewritten
            return f"could not be probed on float64 rows ({type(err).__name__}: {str(err)[:80]})"
        if other.shape != y.shape or not bool(((other - y).abs() <= _PROBE_TOLERANCE * y.abs().clamp_min(1)).all()):
            return "its forward depends on the training mode (train and eval give other outputs on float64 rows)"
        w, b = probe._parameters.get("weight"), probe._parameters.get("bias")
        offsets = (0.0, 1.0) if w is not None else (0.0,)
        for center, offset, eps in itertools.product((True, False), offsets, eps_values):
            want = _form_output(x, center, eps, None if w is None else w + offset, b)
            if y.shape == want.shape and bool(((y - want).abs() <= _PROBE_TOLERANCE * y.abs().clamp_min(1)).all()):
                return NormForm(dim, None if eps is None else float(eps), center, offset)
    tried = "eps " + (str(eps_values[0]) if eps_attr else "1e-5, 1e-6, 1e-12, 1e-8, 1e-7")
    return f"computes none of the norm forms (LayerNorm, RMSNorm; α = w, 1 + w; {tried}) on float64 rows"


def _probe_run(module: nn.Module, dim: int):
    """(the probe copy, its input rows, its output): a shallow copy with real random float64 parameters and no
    hooks, run through ``forward`` on rows of every scale in :data:`_PROBE_SCALES` with a nonzero mean."""
    g = torch.Generator().manual_seed(0)
    probe = copy.copy(module)
    probe._parameters = OrderedDict((k, nn.Parameter(torch.randn(p.shape, generator=g, dtype=torch.float64)))
                                    for k, p in module._parameters.items() if p is not None)
    probe._parameters.update((k, None) for k, p in module._parameters.items() if p is None)
    probe._buffers = OrderedDict((k, None if b is None else torch.randn(b.shape, generator=g, dtype=torch.float64)
                                  if b.is_floating_point() else torch.zeros(b.shape, dtype=b.dtype))
                                 for k, b in module._buffers.items())
    rows = torch.randn(len(_PROBE_SCALES), 6, dim, generator=g, dtype=torch.float64)
    rows = rows + torch.randn(len(_PROBE_SCALES), 6, 1, generator=g, dtype=torch.float64)
    x = rows * torch.tensor(_PROBE_SCALES, dtype=torch.float64)[:, None, None]
    return probe, x, probe.forward(x)


def _form_output(x, center: bool, eps, alpha, beta):
    xc = x - x.mean(-1, keepdim=True) if center else x
    e = torch.finfo(x.dtype).eps if eps is None else eps
    z = xc / torch.sqrt((xc * xc).mean(-1, keepdim=True) + e)
    z = z * alpha if alpha is not None else z
    return z + beta if beta is not None else z
