"""The MoE rewrite of :func:`~.patch.patch_model` (issue 44): experts stored as 3-d parameters (transformers 5's
``@use_experts_implementation`` classes: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, …) compute, in their grouped and
batched forwards, h = ``self._apply_gate(gate_up)`` = act(g)·u on the concatenated projection [g | u] of the tokens
routed to each expert. Stock, that saves the projection (g for act′, u for the product: one storage) and act(g);
an instance-level ``_apply_gate`` running the exact fused GLU op (:mod:`.glu`) saves g and u and recomputes act(g)
in the backward: act(g) is no longer saved, with no gradient error. The gate is proven against the class's own
``_apply_gate`` on a float64 probe (values and both gradients), and the whole model against stock by
:class:`~.rewrite.Savings` like every rewrite; unpatching removes the instance attribute."""

from __future__ import annotations

import torch
from torch import nn

from . import swaps
from .activation_swap import ACTIVATION_CLASSES, class_key
from .glu import GLU_ACTIVATIONS, GLUSpec, glu
from .rewrite import FILTERED, PatchConfig, PatchReport, Savings, Undo, by_pattern, hooks_of

#: The class attribute the grouped and batched forwards call (the rewrite sets an instance attribute over it).
GATE = swaps.EXPERT_GATE
#: The experts implementations that call ``self._apply_gate`` (the eager per-expert loop calls act_fn itself).
GATED_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


class ExactExpertGate:
    """act(g)·u for the concatenated [g | u] of a 3-d-parameter experts module, through the exact fused GLU op
    (saves g and u, recomputes act(g))."""

    def __init__(self, activation: str, use_triton: bool | None = None):
        self.spec, self.use_triton = GLUSpec(activation), use_triton

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, dim=-1)
        return glu(g, u, self.spec, self.use_triton)

    def __repr__(self) -> str:
        return f"ExactExpertGate(glu-{self.spec.activation})"


def _default_gate(module: nn.Module) -> bool:
    """The class applies transformers' default gate, act_fn(g)·u on gate_up.chunk(2) (GPT-OSS's own clamped,
    interleaved gate is another function)."""
    own = getattr(type(module), GATE, None)
    return getattr(own, "__name__", "") == "_default_apply_gate" and getattr(module, "has_gate", False) \
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and module.gate_up_proj.dim() == 3


def candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules with 3-d parameters and the default gate, not rewritten yet."""
    return {n: m for n, m in model.named_modules() if _default_gate(m) and swaps.expert_gate(m) is None}


def _why_not(module: nn.Module) -> str | None:
    """Why the exact gate cannot replace this module's (None when it can): the implementation, the activation, a
    hook on act_fn, or a probe that differs."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in GATED_IMPLEMENTATIONS:
        return (f"its experts run the {implementation!r} implementation, which calls act_fn itself (the exact gate "
                f"needs config._experts_implementation in {GATED_IMPLEMENTATIONS})")
    act = ACTIVATION_CLASSES.get(class_key(module.act_fn))
    if act not in GLU_ACTIVATIONS:
        return f"its act_fn ({type(module.act_fn).__name__}) has no fused GLU (those: {', '.join(GLU_ACTIVATIONS)})"
    if hooks := hooks_of(module.act_fn):
        return f"its act_fn has {', '.join(hooks)}; the fused op would not call it"
    return _probe(module, ExactExpertGate(act, use_triton=False))


def _probe(module: nn.Module, gate: ExactExpertGate) -> str | None:
    """The gate against the class's ``_apply_gate`` in float64 on 64 rows of N(0, 3²) (values, dg and du to 1e-12
    relative); the reason when they differ."""
    width = module.gate_up_proj.shape[-1 if getattr(module, "is_transposed", False) else -2]
    gen = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(64, width, dtype=torch.float64, generator=gen)).requires_grad_()
    dh = torch.randn(64, width // 2, dtype=torch.float64, generator=gen)
    outs = []
    for fn in (lambda t: getattr(type(module), GATE)(module, t), gate):
        y = fn(z)
        (grad,) = torch.autograd.grad(y, z, dh)
        outs.append((y.detach(), grad))
    (y0, g0), (y1, g1) = outs
    off = max(float((y0 - y1).abs().max() / y0.abs().max().clamp_min(1e-300)),
              float((g0 - g1).abs().max() / g0.abs().max().clamp_min(1e-300)))
    return None if off <= 1e-12 else f"the exact gate differs from its _apply_gate by {off:.2g} on a float64 probe"


def fuse_expert_gates(model: nn.Module, report: PatchReport, undo: Undo, config: PatchConfig,
                      savings: Savings) -> None:
    """Install :class:`ExactExpertGate` on every proven experts module (``config.glu``: all, or these paths;
    ``config.module_filter_fn``), one pattern of paths at a time (:class:`~.rewrite.Savings` checks the outputs and
    the bytes); each refusal is reported with its reason."""
    found = candidates(model)
    wanted = (lambda name: config.glu) if isinstance(config.glu, bool) else (lambda name: name in config.glu)
    for pattern, group in by_pattern([n for n in found if wanted(n)]):
        for names in savings.attempts(f"{pattern} (MoE experts)", group):
            for name in names:
                module = found[name]
                why = FILTERED if not config.wants(module, name) else _why_not(module)
                if why:
                    report.skipped.append(f"{name} ({type(module).__name__}): {why}")
                    continue
                gate = ExactExpertGate(ACTIVATION_CLASSES[class_key(module.act_fn)])
                swaps.mark_expert_gate(module, gate)
                undo.steps.append(lambda module=module: swaps.remove_expert_gate(module))
                report.glus.append(f"{name}: {type(module).__name__} → experts with {gate!r} (saves g and u, "
                                   "act(g) recomputed)")
