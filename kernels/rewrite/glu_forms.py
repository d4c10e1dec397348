"""Gated MLPs found by what they run, not by class name: one run of the model records, for every module, the calls
of its direct children and the activation ops it runs itself; a module whose calls are gate(x), up(x) (or one fused
projection chunked in two), an activation of the gate and down(…) last is a candidate, and it becomes a
:class:`~approxbp.kernels.ops.glu.GatedMLP` only once a float64 probe proves that it computes down(act(gate(x))·up(x)).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from approxbp.kernels.ops.torch_private import FakeTensor, storage_key, unset_fake_temporarily
from torch import nn
from torch.overrides import TorchFunctionMode

from ..ops.glu import GLU_ACTIVATIONS, GatedMLP, GLULayout

__all__ = ["fixed_graph", "float64_twin", "functional_activation", "layout_of", "PROOF_NUMEL", "prove", "record_calls"]


#: Activation functions → registry activation (F.gelu by its ``approximate`` argument).
_FUNCTIONAL = {F.silu: "silu", F.mish: "mish", F.gelu: "gelu"}


@dataclass
class _Call:
    child: str
    inp: torch.Tensor | None
    out: object


@dataclass
class _Record:
    x: torch.Tensor | None  # the module's one positional input (None: called otherwise)
    out: object = None
    calls: list[_Call] = field(default_factory=list)
    functional: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (activation, its input)


def functional_activation(func, args, kwargs) -> str | None:
    """The registry activation a torch function call computes (``F.gelu(x, approximate="tanh")``: gelu_tanh), or
    None for any other call."""
    act = _FUNCTIONAL.get(func)
    if act == "gelu" and (kwargs or {}).get("approximate", args[1] if len(args) > 1 else "none") == "tanh":
        return "gelu_tanh"
    return act


def _first_tensor(args) -> torch.Tensor | None:
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


class _ActivationOps(TorchFunctionMode):
    """Records the activation functions called (``F.silu``, ``F.gelu``, ``F.mish``) with the innermost running
    module (a function mode: it sees the call as written, before dispatch)."""

    def __init__(self, running: list[str]):
        super().__init__()
        self.running, self.seen = running, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        act = functional_activation(func, args, kwargs)
        if act is not None and self.running:
            self.seen.append((self.running[-1], act, args[0]))
        return func(*args, **(kwargs or {}))


def record_calls(model: nn.Module, run) -> tuple[dict[str, _Record], list[tuple[str, str]]]:
    """({module: its first call's record}, [(module, activation) for every activation op, with the innermost module
    running it]) from ``run()``, one forward of ``model``."""
    records: dict[str, _Record] = {}
    running: list[str] = []
    watch, handles = _ActivationOps(running), []

    def parent_of(name: str) -> _Record | None:
        parent = name.rpartition(".")[0]
        rec = records.get(parent) if name else None
        return rec if rec is not None and rec.out is None and running and running[-1] == parent else None

    def pre(name):
        def hook(module, args, kwargs):
            if (parent := parent_of(name)) is not None:
                parent.calls.append(_Call(name.rpartition(".")[2], _first_tensor(args), None))
            records.setdefault(name, _Record(_first_tensor(args) if len(args) == 1 and not kwargs else None))
            running.append(name)
        return hook

    def post(name):
        def hook(module, args, kwargs, out):
            if not running or running[-1] != name:
                return
            running.pop()
            if records[name].out is None:
                records[name].out = out
            if (parent := parent_of(name)) is not None and parent.calls and parent.calls[-1].out is None:
                parent.calls[-1].out = out
        return hook

    for name, m in model.named_modules():
        handles += [m.register_forward_pre_hook(pre(name), with_kwargs=True),
                    m.register_forward_hook(post(name), with_kwargs=True, always_call=True)]
    try:
        with watch:
            run()
    finally:
        for h in handles:
            h.remove()
    for module, act, inp in watch.seen:
        records[module].functional.append((act, inp))
    return records, [(m, a) for m, a, _ in watch.seen]


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a is b


def _within(t: torch.Tensor, out: torch.Tensor) -> bool:
    return isinstance(out, torch.Tensor) and storage_key(t) == storage_key(out)


def layout_of(rec: _Record, activation_of) -> tuple[GLULayout, str] | str | None:
    """(layout, activation) when ``rec``'s calls read as a gated MLP; a reason when they nearly do (an activation
    between a projection of the input and a last projection, but not in a form the fused op covers); None when the
    module is no gated MLP at all. ``activation_of(child name)``: the registry activation of an activation child."""
    acts = [(c.child, activation_of(c.child), c.inp) for c in rec.calls if activation_of(c.child)]
    acts += [(None, a, inp) for a, inp in rec.functional]
    others = [c for c in rec.calls if not activation_of(c.child)]
    if rec.x is None or len(acts) != 1 or len(others) not in (2, 3) or not _same(others[-1].out, rec.out):
        return None
    act_child, act, inp = acts[0]
    *inputs, down = others
    if not all(_same(c.inp, rec.x) for c in inputs) or _same(down.inp, rec.x):
        return None
    if len(inputs) == 2:
        gate = [c for c in inputs if _same(c.out, inp)]
        if len(gate) != 1:
            return None
        up = inputs[1] if gate[0] is inputs[0] else inputs[0]
        layout = GLULayout(gate[0].child, up.child, down.child, act=act_child, up_first=up is inputs[0])
    else:
        fused = inputs[0]
        if not _within(inp, fused.out) or inp.shape[-1] * 2 != fused.out.shape[-1]:
            return None
        first = inp.storage_offset() == fused.out.storage_offset()
        layout = GLULayout(fused.child, None, down.child, act=act_child, gate_first=first)
    return (layout, act) if act in GLU_ACTIVATIONS else f"gated by {act}, which has no exact fused GLU"


def float64_twin(module: nn.Module, gen: torch.Generator, f: int = 1) -> nn.Module:
    """A copy of ``module`` in eval mode whose parameters and floating buffers are real random float64 tensors of
    the same shapes (so the proof holds for any weights, and a fake-tensor model — the planner's — can be probed),
    each dimension that ``f`` divides divided by it (:func:`_narrowing`)."""
    twin = copy.copy(module)
    held = {k: float64_twin(v, gen, f) for k, v in module.__dict__.items() if isinstance(v, nn.Module)}  # a norm
    twin.__dict__ = {**module.__dict__, **held, "_parameters": dict(module._parameters),  # NormInputLinear reads
                     "_buffers": dict(module._buffers),
                     "_modules": {n: float64_twin(c, gen, f) if c is not None else None
                                  for n, c in module._modules.items()}}

    def shape(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(d // f if d % f == 0 else d for d in t.shape)
    for name, p in module._parameters.items():
        if p is not None:
            twin._parameters[name] = nn.Parameter(0.5 * torch.randn(shape(p), generator=gen, dtype=torch.float64),
                                                  requires_grad=False)
    for name, b in module._buffers.items():
        if b is not None and b.is_floating_point():
            twin._buffers[name] = torch.randn(shape(b), generator=gen, dtype=torch.float64)
    return twin.eval()


#: A proof's float64 twin holds at most this many weights (256 MiB); a wider MLP is proven narrowed.
PROOF_NUMEL = 1 << 25


def _narrowing(module: nn.Module, features: int) -> int | None:
    """1 when the twin fits :data:`PROOF_NUMEL`; else the largest factor f > 1 dividing the input's feature size and
    every weight dimension of at least 64 (so 2·i stays twice i, the split halves of a fused gate/up) that leaves
    each of them at least 16 wide, or None when there is none. Dividing them all by f keeps the algebra the proof
    checks; a forward that reads sizes it stored itself then fails the proof, and the MLP is left as it is."""
    if sum(p.numel() for p in module.parameters()) <= PROOF_NUMEL:
        return 1
    dims = [features, *(d for p in module.parameters() for d in p.shape if d >= 64)]
    g = math.gcd(*dims)
    return max((f for f in range(2, g + 1) if g % f == 0 and min(dims) // f >= 16), default=None)


#: Proofs made in this process, by what they depend on (:func:`_proof_key`): a model's 80 alike MLPs, or the
#: planner's many runs of one model, are proven once; the least recently used past :data:`_PROVEN_KEPT` are dropped
#: (a long session of many models would otherwise grow it without end).
_PROVEN: OrderedDict = OrderedDict()
_PROVEN_KEPT = 256


def _proof_key(module: nn.Module, layout: GLULayout, act: str, shape: tuple[int, ...]):
    """What a proof depends on, or None (prove this instance): every submodule's class and plain attributes, every
    tensor attribute that is neither parameter nor buffer by its values (the proof reads it as it is), every
    parameter's path and shape (their values are random in the proof, so they do not matter), the layout, the
    activation and the input's feature size. A tensor attribute whose values cannot be read (fake) gives None."""
    parts = []
    for path, m in module.named_modules():
        own = {*m._parameters, *m._buffers}
        plain = sorted((k, v) for k, v in vars(m).items() if isinstance(v, int | float | str | bool))
        tensors = []
        for k, v in sorted(vars(m).items()):
            if isinstance(v, torch.Tensor) and k not in own:
                if v.is_meta or isinstance(v, FakeTensor):
                    return None
                data = v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                tensors.append((k, tuple(v.shape), str(v.dtype), hash(data)))
        parts.append((path, type(m), tuple(plain), tuple(tensors)))
    shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return tuple(parts), shapes, layout, act, len(shape), shape[-1] if shape else None


class _OwnCode(torch.fx.Tracer):
    """Traces a module's own forward only: every submodule is a leaf (the projections and the activation are what
    :class:`GatedMLP` calls as they are)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


def fixed_graph(module: nn.Module) -> str | None:
    """Why ``module``'s forward may compute differently on another input than on the proof's (None when it cannot):
    it must trace (torch.fx, its submodules as leaves) to one graph — a branch on a shape or a value of its input
    stops the trace — and to the same graph in training and in eval mode (a ``self.training`` branch)."""
    modes = {m: m.training for m in module.modules()}
    codes = []
    try:
        for training in (True, False):
            module.train(training)
            try:
                with warnings.catch_warnings():  # hooks see proxies while tracing: not the user's concern
                    warnings.simplefilter("ignore")
                    codes.append(_OwnCode().trace(module).python_code("self").src)
            except Exception as err:  # noqa: BLE001 - what cannot be captured is not rewritten
                first = (str(err).strip().splitlines() or [""])[0]
                return (f"its forward is not one fixed graph of its input ({type(err).__name__}: {first[:100]}), so a "
                        "proof on the example would not cover other inputs")
    finally:
        for m, training in modes.items():
            m.training = training
    if codes[0] != codes[1]:
        return "its forward differs between training and eval mode, so a proof in one would not cover the other"
    return None


def prove(module: nn.Module, layout: GLULayout, act: str, shape: tuple[int, ...]) -> str | None:
    """Why ``GatedMLP(module, layout, act)`` may not replace ``module`` (None when it may): its forward is one fixed
    graph (:func:`fixed_graph`: no branch on its input's shape or values, none on the mode), and both run in
    float64, with random weights, on random inputs of the feature size of ``shape`` (its recorded input's; a few
    rows) at three scales and must agree to 1e-9 relative. Cached per :func:`_proof_key` (never across modules that
    differ in anything the forward reads)."""
    if why := fixed_graph(module):
        return why
    key = _proof_key(module, layout, act, shape)
    if key is None:
        return _prove(module, layout, act, shape)
    if key not in _PROVEN:
        _PROVEN[key] = _prove(module, layout, act, shape)
        while len(_PROVEN) > _PROVEN_KEPT:
            _PROVEN.popitem(last=False)
    _PROVEN.move_to_end(key)
    return _PROVEN[key]


def _prove(module: nn.Module, layout: GLULayout, act: str, shape: tuple[int, ...]) -> str | None:
    f = _narrowing(module, shape[-1]) if len(shape) >= 2 else 1
    if f is None:
        return "too wide to prove in float64 here, and its widths have no common factor to narrow it by"
    rows = (*(1,) * (len(shape) - 2), min(shape[-2], 8), shape[-1] // f) if len(shape) >= 2 else tuple(shape)
    with unset_fake_temporarily(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        stock = float64_twin(module, gen, f)
        ours = GatedMLP(stock, layout, act)
        worst = 0.0
        for scale in (0.3, 2.0, 8.0):
            probe = scale * torch.randn(rows, generator=gen, dtype=torch.float64)
            try:
                want, got = stock(probe), ours(probe)
            except Exception as err:  # noqa: BLE001 - what cannot be checked is not rewritten
                return f"could not be checked as a gated MLP ({type(err).__name__}: {str(err)[:80]})"
            if not isinstance(want, torch.Tensor) or want.shape != got.shape:
                return "returns something other than one tensor of the fused form's shape"
            worst = max(worst, float((want - got).abs().max()) / max(1.0, float(want.abs().max())))
    if not worst <= 1e-9:
        return f"does not compute down(act(gate)·up) (max relative difference {worst:.3g} in float64)"
    return None


