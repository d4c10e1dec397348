"""The MoE rewrite of :func:`~.patch.patch_model`: experts stored as 3-d parameters (transformers 5's
``@use_experts_implementation`` classes: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, …) compute, in their grouped and
batched forwards, h = ``self._apply_gate(gate_up)`` = act(g)·u on the concatenated projection [g | u] of the tokens
routed to each expert. Stock, that saves the projection (g for act′, u for the product: one storage) and act(g);
an instance-level ``_apply_gate`` running the exact fused GLU op (:mod:`.glu`) saves g and u and recomputes act(g)
in the backward: act(g) is no longer saved, with no gradient error. The gate is proven against the class's own
``_apply_gate`` on a float64 probe (values and both gradients), and the whole model against stock by
:class:`~.common.RewriteGuard` like every rewrite; unpatching removes the instance attribute."""

from __future__ import annotations

import torch
from approxbp.kernels.ops.torch_private import unset_fake_temporarily
from torch import nn

from ..ops.glu import GLU_ACTIVATIONS, GLUSpec, glu
from . import swaps
from .activation_swap import ACTIVATION_CLASSES, class_key
from .bound_forward import BoundForward
from .common import FILTERED, PatchConfig, PatchReport, RewriteGuard, Undo, by_pattern, hooks_of
from .glu_forms import float64_twin

__all__ = ["bmm_experts_forward", "candidates", "ExactExpertGate", "experts_forward", "fuse_expert_gates"]


#: The class attribute the grouped and batched forwards call (the rewrite sets an instance attribute over it).
_GATE = swaps.EXPERT_GATE
#: The experts implementations that call ``self._apply_gate`` (the eager per-expert loop calls act_fn itself).
_GATED_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


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


def _recomputes_down_input(module: nn.Module) -> bool:
    """The grouped forward without expert parallelism or a post-expert norm: the one :func:`experts_forward`
    writes (the others keep the exact gate alone)."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return implementation == "grouped_mm" and not getattr(module, "_is_expert_parallel", False) and not getattr(
        module, "has_post_expert_norm", False)


def experts_forward(module: nn.Module) -> BoundForward:
    """The grouped experts forward of transformers' ``grouped_mm`` implementation (tokens sorted by expert, the up
    projection [g | u] = x Wᵤ (+ b) per expert, h = gate(g, u), the down projection h W_d (+ b), the routing weights,
    the tokens' top-k outputs summed) with the gate and the down projection under one non-reentrant checkpoint: it
    keeps [g | u] (which the gate saves anyway) in place of h and the gate's intermediates, and recomputes the gate
    in the backward — elementwise work, no matmul; every value and gradient is the stock one. The gate is
    ``module._apply_gate``: the exact act(g)·u, or a class's own (GPT-OSS's clamped, interleaved one)."""
    return BoundForward(_grouped_forward, module, module.forward)


def _grouped_forward(module: nn.Module, inner, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint
    from transformers.integrations.moe import _grouped_linear

    biased = getattr(module, "has_bias", False)  # GPT-OSS: a bias per expert, one row per routed token

    def rows(name: str, expert_of: torch.Tensor | None):
        return getattr(module, name)[expert_of] if biased else None

    def gate_down(gate_up: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, expert_of: torch.Tensor):
        return _grouped_linear(module._apply_gate(gate_up), weight, offsets, bias=rows("down_proj_bias", expert_of),
                               is_transposed=module.is_transposed)  # (the bias rows gathered here: not kept)

    k = top_k_index.size(-1)
    expert_of, perm = torch.sort(top_k_index.reshape(-1))
    counts = torch.histc(expert_of.float() if expert_of.device.type in ("cpu", "mps") else expert_of.int(),
                         bins=module.num_experts, min=0, max=module.num_experts - 1)  # as transformers counts
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # (histc has a fake kernel; bincount has none)
    gate_up = _grouped_linear(hidden_states[perm // k], module.gate_up_proj, offsets,
                              bias=rows("gate_up_proj_bias", expert_of), is_transposed=module.is_transposed)
    out = checkpoint(gate_down, gate_up, module.down_proj, offsets, expert_of if biased else None,
                     use_reentrant=False)  # (the indices kept only where a bias needs them)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[back].view(hidden_states.shape[0], k, -1).sum(dim=1).to(hidden_states.dtype)


def _bmm_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules with a forward of their own (no ``_apply_gate``: Llama-4's): 3-d ``gate_up_proj`` [E, H, 2I]
    and ``down_proj`` [E, I, H] parameters and an ``act_fn``, not rewritten yet."""
    def fits(m: nn.Module) -> bool:
        gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
                and gu.shape[-1] == 2 * down.shape[1] and gu.shape[1] == down.shape[2]
                and isinstance(getattr(m, "act_fn", None), nn.Module) and not hasattr(type(m), _GATE))
    return {n: m for n, m in model.named_modules() if fits(m) and swaps.expert_gate(m) is None}


def bmm_experts_forward(module: nn.Module) -> BoundForward:
    """Llama-4's experts forward (the tokens viewed per expert, [g | u] = x·W_gu by bmm, u·act(g), then ·W_d by bmm),
    with act and the down projection under one non-reentrant checkpoint: [g | u] is kept in place of act(g) and of
    the down projection's input u·act(g), both recomputed in the backward (elementwise). The same ops in the same
    order: the stock values and gradients."""
    return BoundForward(_bmm_forward, module, module.forward)


def _bmm_forward(module: nn.Module, inner, hidden_states: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    def act_down(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.bmm(up * module.act_fn(gate), weight)

    x = hidden_states.view(module.gate_up_proj.shape[0], -1, module.gate_up_proj.shape[1])
    out = checkpoint(act_down, torch.bmm(x, module.gate_up_proj), module.down_proj, use_reentrant=False)
    return out.view(-1, module.down_proj.shape[-1])


def _probe_bmm(module: nn.Module) -> str | None:
    """:func:`bmm_experts_forward` against the module's own forward on a float64 copy: 4 tokens per expert of N(0, 1),
    the output and the gradients of the tokens and the parameters to 1e-12 relative; the reason when they differ."""
    with unset_fake_temporarily():
        probe = _real_twin(module, torch.float64)
        gen = torch.Generator().manual_seed(0)
        experts, width = probe.gate_up_proj.shape[:2]
        x = torch.randn(experts * 4, width, dtype=torch.float64, generator=gen).requires_grad_()
        try:
            off = _difference(probe, lambda: bmm_experts_forward(probe), (x,), (x,))
        except Exception as err:  # noqa: BLE001 - a forward that takes other inputs is not this one
            return f"could not be probed as Llama-4's experts ({type(err).__name__}: {str(err)[:80]})"
    return None if off <= 1e-12 else f"its forward is not u·act(g) by bmm per expert (off by {off:.2g})"


def _real_twin(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` whose parameters are real random tensors of their shapes in ``dtype``, requiring grad (so
    a probe holds for any weights, and the planner's fake-tensor model can be probed); call it outside fake mode."""
    twin = float64_twin(module, torch.Generator().manual_seed(1)).to(dtype).train(module.training)
    for p in twin.parameters():
        p.requires_grad_()
    return twin


def _difference(probe: nn.Module, make_ours, args: tuple, wrt: tuple) -> float:
    """The largest relative difference between ``probe``'s own forward and the one ``make_ours()`` returns (made after
    the stock run) on ``args``: the outputs, and the gradients of ``wrt`` and of the parameters for a ones cotangent."""
    got = []
    for run in (probe.forward, None):
        run = run or make_ours()
        y = run(*args)
        grads = torch.autograd.grad(y, [*wrt, *probe.parameters()], torch.ones_like(y))
        got.append([y.detach(), *grads])
    return max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-300)) for a, b in zip(*got))


def _gate_of(module: nn.Module) -> str | None:
    """The name of the gate a gated experts module with a 3-d ``gate_up_proj`` applies (its class's
    ``_apply_gate``: transformers' ``_default_apply_gate``, act_fn(g)·u on gate_up.chunk(2), or a class's own, such
    as GPT-OSS's clamped, interleaved one); None for any other module."""
    own = getattr(type(module), _GATE, None)
    gated = getattr(module, "has_gate", False) and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    return getattr(own, "__name__", "") if own is not None and gated and module.gate_up_proj.dim() == 3 else None


def _default_gate(module: nn.Module) -> bool:
    """The class applies transformers' default gate (:func:`_gate_of`)."""
    return _gate_of(module) == "_default_apply_gate"


def candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules with 3-d parameters and the default gate, not rewritten yet."""
    return {n: m for n, m in model.named_modules() if _default_gate(m) and swaps.expert_gate(m) is None}


def _own_gate_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules with 3-d parameters whose class defines its own ``_apply_gate`` (GPT-OSS), not rewritten
    yet: no fused GLU computes their gate, but :func:`experts_forward` recomputes it."""
    return {n: m for n, m in model.named_modules()
            if _gate_of(m) not in (None, "_default_apply_gate") and swaps.expert_gate(m) is None}


def _own_gate(module: nn.Module):
    """The class's own ``_apply_gate``, bound to ``module``."""
    return getattr(type(module), _GATE).__get__(module)


def _why_not_own(module: nn.Module) -> str | None:
    """Why :func:`experts_forward` cannot run an own-gate experts module (None when it can)."""
    if not _recomputes_down_input(module):
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
        return (f"its own gate runs in the {implementation!r} implementation (with expert parallelism or a "
                "post-expert norm): only the grouped_mm forward is rewritten")
    return _probe_forward(module, None)


def _why_not(module: nn.Module) -> str | None:
    """Why the exact gate cannot replace this module's (None when it can): the implementation, the activation, a
    hook on act_fn, or a probe that differs."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in _GATED_IMPLEMENTATIONS:
        return (f"its experts run the {implementation!r} implementation, which calls act_fn itself (the exact gate "
                f"needs config._experts_implementation in {_GATED_IMPLEMENTATIONS})")
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
    with unset_fake_temporarily():
        probe = _real_twin(module, torch.float64)
        gen = torch.Generator().manual_seed(0)
        z = (3 * torch.randn(64, width, dtype=torch.float64, generator=gen)).requires_grad_()
        dh = torch.randn(64, width // 2, dtype=torch.float64, generator=gen)
        outs = []
        for fn in (lambda t: getattr(type(probe), _GATE)(probe, t), gate):
            y = fn(z)
            (grad,) = torch.autograd.grad(y, z, dh)
            outs.append((y.detach(), grad))
        (y0, g0), (y1, g1) = outs
        off = max(float((y0 - y1).abs().max() / y0.abs().max().clamp_min(1e-300)),
                  float((g0 - g1).abs().max() / g0.abs().max().clamp_min(1e-300)))
    return None if off <= 1e-12 else f"the exact gate differs from its _apply_gate by {off:.2g} on a float64 probe"


def _probe_forward(module: nn.Module, gate: ExactExpertGate | None) -> str | None:
    """:func:`experts_forward` with ``gate`` (None: the class's own) against the module's own forward on a float32
    copy (grouped_mm takes no float64): 12
    tokens routed to 2 experts each, outputs and the gradients of the tokens, the routing weights and the parameters
    to 1e-6 relative (the same ops in the same order: equal in practice)."""
    def ours():
        swaps.mark_expert_gate(probe, gate or _own_gate(probe), experts_forward(probe))
        return probe.forward

    with unset_fake_temporarily():
        probe = _real_twin(module, torch.float32)
        gen = torch.Generator().manual_seed(0)
        width = probe.down_proj.shape[-1 if probe.is_transposed else -2]  # the hidden size
        x = torch.randn(12, width, generator=gen).requires_grad_()
        index = torch.stack([torch.randperm(probe.num_experts, generator=gen)[:2] for _ in range(12)])
        weights = torch.rand(12, 2, generator=gen).requires_grad_()
        off = _difference(probe, ours, (x, index, weights), (x, weights))
    return None if off <= 1e-6 else f"the experts' forward with act(g)·u recomputed differs by {off:.2g}"


def fuse_expert_gates(model: nn.Module, report: PatchReport, undo: Undo, config: PatchConfig,
                      savings: RewriteGuard) -> None:
    """Install :class:`ExactExpertGate` on every proven experts module with transformers' gate, :func:`experts_forward`
    around the class's own gate where it has one (GPT-OSS), and :func:`bmm_experts_forward` on every proven one with
    a forward of its own (``config.glu``: all, or these paths;
    ``config.module_filter_fn``), one pattern of paths at a time (:class:`~.common.RewriteGuard` checks the outputs and
    the bytes); each refusal is reported with its reason."""
    for name, module in _proven(candidates(model), "MoE experts", _why_not, report, config, savings):
        gate = ExactExpertGate(ACTIVATION_CLASSES[class_key(module.act_fn)])
        own = _recomputes_down_input(module) and _probe_forward(module, gate) is None
        swaps.mark_expert_gate(module, gate, experts_forward(module) if own else None)
        undo.steps.append(lambda module=module: swaps.remove_expert_gate(module))
        report.glus.append(f"{name}: {type(module).__name__} → experts with {gate!r} (saves g and u, act(g) "
                           "recomputed" + ("; the down projection's input act(g)·u recomputed too)" if own else ")"))
    for name, module in _proven(_own_gate_candidates(model), "MoE experts, own gate", _why_not_own, report, config,
                                savings):
        swaps.mark_expert_gate(module, _own_gate(module), experts_forward(module))
        undo.steps.append(lambda module=module: swaps.remove_expert_gate(module))
        report.glus.append(f"{name}: {type(module).__name__} → experts with its own gate and the down projection "
                           "recomputed from [g | u] in the backward (saves [g | u], not the gate's intermediates)")
    for name, module in _proven(_bmm_candidates(model), "MoE experts, own forward", _probe_bmm, report, config,
                                savings):
        forward = bmm_experts_forward(module)
        swaps.mark_expert_gate(module, forward, forward)  # the forward is the marker: no _apply_gate here
        undo.steps.append(lambda module=module: swaps.remove_expert_gate(module))
        report.glus.append(f"{name}: {type(module).__name__} → experts with act(g) and the down projection's input "
                           "u·act(g) recomputed in the backward (saves [g | u])")


def _proven(found: dict[str, nn.Module], label: str, why_not, report: PatchReport, config: PatchConfig,
            savings: RewriteGuard):
    """(name, module) of each wanted module of ``found`` that ``why_not`` finds nothing against, one pattern of
    paths at a time inside :meth:`~.common.RewriteGuard.attempts`; the others reported with their reason."""
    wanted = (lambda name: config.glu) if isinstance(config.glu, bool) else (lambda name: name in config.glu)
    for pattern, group in by_pattern([n for n in found if wanted(n)]):
        for names in savings.attempts(f"{pattern} ({label})", group):
            for name in names:
                module = found[name]
                why = FILTERED if not config.wants(module, name) else why_not(module)
                if why:
                    report.skipped.append(f"{name} ({type(module).__name__}): {why}")
                else:
                    yield name, module
