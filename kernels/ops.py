"""The drop-ins' kernels as PyTorch custom ops (``torch.library.custom_op``), with fake implementations and
registered autograd, so that ``torch.compile(fullgraph=True)``, ``torch.export``, CUDA graphs, DDP/FSDP and
activation checkpointing see one opaque op per call and keep our backward.

A table's constants, its generated module and its PyTorch twin live in a *spec* object built once, when the
``nn.Module`` is constructed, and registered here under a string key; the ops receive that key. Nothing on the
call path reads files, parses tables or touches numpy. ``use_triton`` picks the generated Triton kernels (CUDA,
or the CPU under ``TRITON_INTERPRET=1``) or the twin; ``out_dtype`` is the autocast policy (see ``autocast_dtype``).

    approxbp::relu_sum_forward(x, key, use_triton) → (y, packed codes, NaN bytes)   saves codes + NaN bytes
    approxbp::invact_forward(x, key, use_triton, out_dtype) → (y, branch bits)       saves y + bits (none: monotone)
    approxbp::ms_norm_forward(x, eps, center, use_triton, out_dtype) → (z, σ⁻¹)       saves z + σ⁻¹
    approxbp::glu_forward(g, u, key, use_triton) → act(g)·u                          saves g + u

Two ways in, one set of implementations. While dynamo traces (``torch.compile``, ``torch.export``) the drop-ins
call the custom ops. In eager mode they call :func:`relu_sum`, :func:`invact` and :func:`ms_norm` below, which
use a plain ``torch.autograd.Function`` around the same implementations and save the same tensors: a custom
op's Python dispatch costs more host time per call than the twin's whole computation on small tensors
(``benchmarks/host_overhead.py``). Without grad (inference) the twins skip the codes altogether.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

SPECS: dict[str, object] = {}


def register(spec) -> str:
    """Make ``spec`` (with a ``key`` attribute) reachable from the ops; returns its key."""
    SPECS[spec.key] = spec  # equal keys are equal definitions: the latest (whose module surely exists) serves
    return spec.key


def spec_key(family: str, sha256: str, path, kernels_dir: str | None) -> str:
    """``family:definition-sha256:source[@kernels_dir]``, where source is the packaged table's name or the user
    table's absolute path: any process can rebuild the spec from it (:func:`spec_of`), so a ``torch.export``ed
    program runs where only ``approxbp.kernels`` was imported."""
    from approxbp.approximations.tables import packaged_name

    source = packaged_name(path) or str(Path(path).resolve())
    return f"{family}:{sha256}:{_escape(source)}" + (f"@{_escape(kernels_dir)}" if kernels_dir else "")


def _escape(text: str) -> str:
    """``%`` and ``@`` percent-encoded, so that ``@`` in a key only ever separates the kernels folder."""
    return text.replace("%", "%25").replace("@", "%40")


def _unescape(text: str) -> str:
    return text.replace("%40", "@").replace("%25", "%")


def spec_of(key: str):
    """The spec registered under ``key``, or rebuilt from it (and registered) in a process that never built the
    module; refused when the table changed since the key was made."""
    spec = SPECS.get(key)
    if spec is None and key.startswith("glu:"):
        from .glu import GLUSpec

        spec = GLUSpec(key.split(":", 1)[1])
        register(spec)
    if spec is None:
        family, sha, source = key.split(":", 2)
        source, _, kernels_dir = source.partition("@")
        source, kernels_dir = _unescape(source), _unescape(kernels_dir)
        if family == "relu-sum":
            from .relu_sum import ReLUSumSpec as make
        else:
            from .invact import InvActSpec as make
        spec = make(source, kernels_dir or None)
        if spec.sha256 != sha:
            raise RuntimeError(f"this program was made with {source} of definition sha256 {sha[:16]}…; that table "
                               f"is now {spec.sha256[:16]}…: export the program again")
        register(spec)
    return spec


def attach(spec, use_triton: bool | None):
    """What a drop-in does once, at construction: check that Triton can run when asked to, and register its spec
    (which imported its generated module when it was built, so that no forward pass touches files)."""
    from .guards import check_triton_available

    check_triton_available(use_triton)
    register(spec)
    return spec


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast dtype for ``x``'s device when autocast is on and ``x`` is wider, else None.

    The policy: under autocast an op whose output the next Linear consumes returns the autocast dtype, so that
    the Linear's own cast is a no-op and both save the *same* tensor (MS-norm's z, InvAct's y)."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) and x.dtype in (torch.float32, torch.float64):
        return torch.get_autocast_dtype(dev)
    return None


# ---- the implementations both entry points call (the custom ops below, the eager Functions at the end) ------
def _relu_sum_fwd(x, spec, use_triton):
    y, packed, nan = (spec.forward_triton if use_triton else spec.forward_torch)(x)
    return y.view(x.shape), packed, nan


def _relu_sum_bwd(g, packed, nan, spec, use_triton):
    return (spec.backward_triton if use_triton else spec.backward_torch)(g, packed, nan, g.numel()).view(g.shape)


def _invact_fwd(x, spec, use_triton, out_dtype):
    y, bits = (spec.forward_triton if use_triton else spec.forward_torch)(x)
    y = y.view(x.shape)
    return (y if out_dtype is None else y.to(out_dtype)), bits


def _invact_bwd(g, y, bits, spec, use_triton, dtype):
    g = g.to(dtype)
    return (spec.backward_triton if use_triton else spec.backward_torch)(g, y, bits).view(g.shape)


# ---- ReLU-sum ---------------------------------------------------------------------------------------------
@torch.library.custom_op("approxbp::relu_sum_forward", mutates_args=())
def relu_sum_forward(x: Tensor, key: str, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _relu_sum_fwd(x, spec_of(key), use_triton)


@relu_sum_forward.register_fake
def _(x, key, use_triton):
    spec = spec_of(key)
    n = x.numel()
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((spec.packed_bytes(n),), dtype=torch.uint8),
            x.new_empty(((n + spec.nan_span - 1) // spec.nan_span,), dtype=torch.uint8))


@torch.library.custom_op("approxbp::relu_sum_backward", mutates_args=())
def relu_sum_backward(g: Tensor, packed: Tensor, nan: Tensor, key: str, use_triton: bool) -> Tensor:
    return _relu_sum_bwd(g, packed, nan, spec_of(key), use_triton)


@relu_sum_backward.register_fake
def _(g, packed, nan, key, use_triton):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def _relu_sum_setup(ctx, inputs, output):
    _, ctx.key, ctx.use_triton = inputs
    ctx.save_for_backward(output[1], output[2])


def _relu_sum_grad(ctx, gy, *_):
    packed, nan = ctx.saved_tensors
    return relu_sum_backward(gy, packed, nan, ctx.key, ctx.use_triton), None, None


relu_sum_forward.register_autograd(_relu_sum_grad, setup_context=_relu_sum_setup)


# ---- inverted activations ---------------------------------------------------------------------------------
@torch.library.custom_op("approxbp::invact_forward", mutates_args=())
def invact_forward(x: Tensor, key: str, use_triton: bool, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    return _invact_fwd(x, spec_of(key), use_triton, out_dtype)


@invact_forward.register_fake
def _(x, key, use_triton, out_dtype):
    return (torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format),
            x.new_empty((spec_of(key).bit_bytes(x.numel()),), dtype=torch.uint8))


@torch.library.custom_op("approxbp::invact_backward", mutates_args=())
def invact_backward(g: Tensor, y: Tensor, bits: Tensor, key: str, use_triton: bool, dtype: torch.dtype) -> Tensor:
    return _invact_bwd(g, y, bits, spec_of(key), use_triton, dtype)


@invact_backward.register_fake
def _(g, y, bits, key, use_triton, dtype):
    return torch.empty_like(g, dtype=dtype, memory_format=torch.contiguous_format)


def _invact_setup(ctx, inputs, output):
    x, ctx.key, ctx.use_triton, _ = inputs
    ctx.dtype = x.dtype
    ctx.save_for_backward(*output)


def _invact_grad(ctx, gy, _):
    y, bits = ctx.saved_tensors
    return invact_backward(gy, y, bits, ctx.key, ctx.use_triton, ctx.dtype), None, None, None


invact_forward.register_autograd(_invact_grad, setup_context=_invact_setup)


# ---- memory-sharing norms ---------------------------------------------------------------------------------
@torch.library.custom_op("approxbp::ms_norm_forward", mutates_args=())
def ms_norm_forward(x: Tensor, eps: float, center: bool, use_triton: bool,
                    out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    from .norms import ms_norm_forward_impl

    return ms_norm_forward_impl(x, eps, center, use_triton, out_dtype)


@ms_norm_forward.register_fake
def _(x, eps, center, use_triton, out_dtype):
    acc = torch.promote_types(x.dtype, torch.float32)
    return (torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format),
            x.new_empty((*x.shape[:-1], 1), dtype=acc))


@torch.library.custom_op("approxbp::ms_norm_backward", mutates_args=())
def ms_norm_backward(dz: Tensor, z: Tensor, rstd: Tensor, center: bool, use_triton: bool,
                     dtype: torch.dtype) -> Tensor:
    from .norms import ms_norm_backward_impl

    return ms_norm_backward_impl(dz, z, rstd, center, use_triton, dtype)


@ms_norm_backward.register_fake
def _(dz, z, rstd, center, use_triton, dtype):
    return torch.empty_like(dz, dtype=dtype, memory_format=torch.contiguous_format)


def _ms_norm_setup(ctx, inputs, output):
    x, _, ctx.center, ctx.use_triton, _ = inputs
    ctx.dtype = x.dtype
    ctx.save_for_backward(*output)


def _ms_norm_grad(ctx, dz, _):
    z, rstd = ctx.saved_tensors
    return ms_norm_backward(dz, z, rstd, ctx.center, ctx.use_triton, ctx.dtype), None, None, None, None


ms_norm_forward.register_autograd(_ms_norm_grad, setup_context=_ms_norm_setup)


# ---- exact gated linear units -------------------------------------------------------------------------
def _glu_fwd(g, u, spec, use_triton):
    return (spec.forward_triton if use_triton else spec.forward_torch)(g, u).view(g.shape)


def _glu_bwd(dh, g, u, spec, use_triton):
    dg, du = (spec.backward_triton if use_triton else spec.backward_torch)(dh.to(g.dtype), g, u)
    return dg.view(g.shape), du.view(u.shape)


@torch.library.custom_op("approxbp::glu_forward", mutates_args=())
def glu_forward(g: Tensor, u: Tensor, key: str, use_triton: bool) -> Tensor:
    return _glu_fwd(g, u, spec_of(key), use_triton)


@glu_forward.register_fake
def _(g, u, key, use_triton):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


@torch.library.custom_op("approxbp::glu_backward", mutates_args=())
def glu_backward(dh: Tensor, g: Tensor, u: Tensor, key: str, use_triton: bool) -> tuple[Tensor, Tensor]:
    return _glu_bwd(dh, g, u, spec_of(key), use_triton)


@glu_backward.register_fake
def _(dh, g, u, key, use_triton):
    return (torch.empty_like(g, memory_format=torch.contiguous_format),
            torch.empty_like(u, memory_format=torch.contiguous_format))


def _glu_setup(ctx, inputs, output):
    g, u, ctx.key, ctx.use_triton = inputs
    ctx.save_for_backward(g, u)


def _glu_grad(ctx, dh):
    g, u = ctx.saved_tensors
    return (*glu_backward(dh, g, u, ctx.key, ctx.use_triton), None, None)


glu_forward.register_autograd(_glu_grad, setup_context=_glu_setup)


# ---- eager entry points: one autograd.Function per op, custom ops while dynamo traces ---------------------
#: What the drop-ins' autograd supports, said wherever something else is asked of it.
FIRST_ORDER_ONLY = ("approxbp drop-ins support first-order reverse-mode autograd only (loss.backward(), "
                    "torch.autograd.grad, torch.func.grad and jacrev, torch.func.vjp's function called with "
                    "create_graph=False); {what} is refused: their backward is an "
                    "approximation (ReLU-sum, InvAct) or treats σ⁻¹ as a constant (MS-norms), so {why}; "
                    "unpatch the model (approxbp.kernels.unpatch) for {what}")
#: Kept for callers of 0.1: the MS-norms' refusal of a second derivative.
ONCE_DIFFERENTIABLE = FIRST_ORDER_ONLY.format(what="a second derivative (create_graph=True)",
                                              why="a second derivative through it would be wrong")


def _refuse(what: str, why: str):
    raise RuntimeError(FIRST_ORDER_ONLY.format(what=what, why=why))


def _transformed(x: Tensor) -> bool:
    """x is inside a torch.func transform or forward-mode AD."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x) or _forward_ad._current_level >= 0


def _needs_grad(x: Tensor) -> bool:
    """Whether the call must go through the autograd Function: grad is on and x requires it, or x is inside a
    torch.func transform or forward-mode AD (which the Function then serves or refuses, never the exact twin)."""
    return (x.requires_grad and torch.is_grad_enabled()) or _transformed(x)


_AS_KERNELS = contextvars.ContextVar("approxbp_as_kernels", default=False)


@contextlib.contextmanager
def as_kernels():
    """Within: the eager entry points call the custom ops, as under dynamo, so a dispatch mode (PyTorch's MemTracker,
    FakeTensorMode) sees each drop-in as one operator that allocates only its outputs, as its Triton kernel does;
    the CPU reference path's temporaries stay inside the op."""
    token = _AS_KERNELS.set(True)
    try:
        yield
    finally:
        _AS_KERNELS.reset(token)


def _opaque() -> bool:
    return torch.compiler.is_compiling() or _AS_KERNELS.get()  # in this order: dynamo cannot trace .get()


def _once_differentiable(backward):
    """A backward that refuses to be part of a second derivative (:data:`FIRST_ORDER_ONLY`): under
    create_graph=True (the engine turns grad on in a backward only then) or nested torch.func.grad/jvp. A
    once-differentiable node would not do: ``torch.autograd.grad(…, x)`` prunes a node that does not lead to x, and
    a second derivative would then silently miss its term."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # a plain backward: only create_graph=True or torch.func turn grad on
            return backward(ctx, *grads)
        with torch.no_grad():
            results = backward(ctx, *grads)
        levels = _functorch_derivative_levels()
        under_func = levels or any(isinstance(r, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(r)
                                   for r in results)
        if levels > 1 or not under_func:
            _refuse("a second derivative (create_graph=True, nested torch.func.grad)",
                    "a second derivative through it would be wrong")
        return results
    return wrapper


def _functorch_derivative_levels() -> int:
    """How many torch.func grad/jvp transforms are active (2 or more: a higher derivative is being taken)."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return sum(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters())


class _FirstOrder(torch.autograd.Function):
    """Base of the eager Functions (forward + setup_context, so torch.func.grad and vjp compose; backwards
    :func:`_once_differentiable`): forward-mode AD and vmap are refused in one line (:data:`FIRST_ORDER_ONLY`).
    Outside torch.func and forward-mode AD each runs as its :func:`_classic` twin (:func:`_apply`)."""

    @staticmethod
    def jvp(ctx, *tangents):
        _refuse("forward-mode AD (torch.func.jvp, torch.autograd.forward_ad)",
                "a forward-mode derivative would not match the backward pass")

    @staticmethod
    def vmap(info, in_dims, *args):
        _refuse("torch.func.vmap (and jacrev/jacfwd/hessian, which use it)", "no batching rule is defined")


@functools.cache
def _classic(fn: type[_FirstOrder]) -> type[torch.autograd.Function]:
    """``fn`` as a classic Function (forward(ctx, …) calling fn's forward and setup_context, fn's backward): for a
    setup_context Function, ``Function.apply`` binds default arguments with ``inspect.signature`` on every call
    (about 50 µs of host time per drop-in per step, benchmarks/host_overhead.py)."""
    def forward(ctx, *args):
        out = fn.forward(*args)
        fn.setup_context(ctx, args, out)
        return out

    return type(f"{fn.__name__}Classic", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(fn.backward)})


def _apply(fn: type[_FirstOrder], x: Tensor, *args):
    """``fn`` applied to (x, *args): itself under torch.func or forward-mode AD, else its classic twin."""
    return (fn if _transformed(x) else _classic(fn)).apply(x, *args)


class _ReluSum(_FirstOrder):
    @staticmethod
    def forward(x, spec, use_triton):
        return _relu_sum_fwd(x, spec, use_triton)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, packed, nan = output
        ctx.mark_non_differentiable(packed, nan)
        ctx.save_for_backward(packed, nan)
        ctx.spec, ctx.use_triton = inputs[1], inputs[2]

    @staticmethod
    @_once_differentiable
    def backward(ctx, gy, _packed, _nan):
        return _relu_sum_bwd(gy, *ctx.saved_tensors, ctx.spec, ctx.use_triton), None, None


def relu_sum(x: Tensor, spec, use_triton: bool) -> Tensor:
    """y = h(x); saves the packed codes and NaN bytes (``approxbp::relu_sum_forward`` under dynamo)."""
    if _opaque():
        return relu_sum_forward(x, spec.key, use_triton)[0]
    if not use_triton and not _needs_grad(x):
        return spec.forward_only_torch(x)
    return _apply(_ReluSum, x, spec, use_triton)[0]


class _InvAct(_FirstOrder):
    @staticmethod
    def forward(x, spec, use_triton, out_dtype):
        return _invact_fwd(x, spec, use_triton, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y, bits = output
        ctx.mark_non_differentiable(bits)
        ctx.save_for_backward(y, bits)
        ctx.spec, ctx.use_triton, ctx.dtype = inputs[1], inputs[2], inputs[0].dtype

    @staticmethod
    @_once_differentiable
    def backward(ctx, gy, _bits):
        return _invact_bwd(gy, *ctx.saved_tensors, ctx.spec, ctx.use_triton, ctx.dtype), None, None, None


def invact(x: Tensor, spec, use_triton: bool, out_dtype: torch.dtype | None) -> Tensor:
    """y = f(x) in ``out_dtype`` (default x's); saves y and one branch bit per element."""
    if _opaque():
        return invact_forward(x, spec.key, use_triton, out_dtype)[0]
    if not use_triton and not _needs_grad(x):
        y = spec.forward_only_torch(x)
        return y if out_dtype is None else y.to(out_dtype)
    return _apply(_InvAct, x, spec, use_triton, out_dtype)[0]


class _MSNorm(_FirstOrder):
    @staticmethod
    def forward(x, eps, center, use_triton, out_dtype):
        from .norms import ms_norm_forward_impl

        return ms_norm_forward_impl(x, eps, center, use_triton, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.save_for_backward(z, rstd)
        ctx.center, ctx.use_triton, ctx.dtype = inputs[2], inputs[3], inputs[0].dtype

    @staticmethod
    @_once_differentiable
    def backward(ctx, dz, _rstd):
        from .norms import ms_norm_backward_impl

        z, rstd = ctx.saved_tensors
        return ms_norm_backward_impl(dz, z, rstd, ctx.center, ctx.use_triton, ctx.dtype), None, None, None, None


def ms_norm(x: Tensor, eps: float, center: bool, use_triton: bool, out_dtype: torch.dtype | None) -> Tensor:
    """z = σ⁻¹·H·x (``center``) or σ⁻¹·x; saves z and σ⁻¹ (``approxbp::ms_norm_forward`` under dynamo)."""
    if _opaque():
        return ms_norm_forward(x, eps, center, use_triton, out_dtype)[0]
    return _apply(_MSNorm, x, eps, center, use_triton, out_dtype)[0]


class _GLU(_FirstOrder):
    @staticmethod
    def forward(g, u, spec, use_triton):
        return _glu_fwd(g, u, spec, use_triton)

    @staticmethod
    def setup_context(ctx, inputs, output):
        g, u, ctx.spec, ctx.use_triton = inputs
        ctx.save_for_backward(g, u)

    @staticmethod
    @_once_differentiable
    def backward(ctx, dh):
        return (*_glu_bwd(dh, *ctx.saved_tensors, ctx.spec, ctx.use_triton), None, None)


def glu(g: Tensor, u: Tensor, spec, use_triton: bool) -> Tensor:
    """h = act(g)·u exactly; saves g and u (``approxbp::glu_forward`` under dynamo)."""
    if _opaque():
        return glu_forward(g, u, spec.key, use_triton)
    if not use_triton and not (_needs_grad(g) or _needs_grad(u)):
        return spec.forward_torch(g, u)
    return (_GLU if _transformed(g) or _transformed(u) else _classic(_GLU)).apply(g, u, spec, use_triton)
