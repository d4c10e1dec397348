"""What every drop-in's entry point shares: PyTorch custom ops (``torch.library.custom_op``, with fake
implementations and registered autograd) so that ``torch.compile(fullgraph=True)``, ``torch.export``, CUDA graphs,
DDP/FSDP and activation checkpointing see one opaque op per call and keep our backward, and, in eager mode, a plain
``torch.autograd.Function`` around the same implementations that saves the same tensors: a custom op's Python
dispatch costs more host time per call than the twin's whole computation on small tensors
(``benchmarks/host_overhead.py``). Without grad (inference) the twins skip the saved codes altogether.

Every op is described once, as an :class:`Op` (forward, backward, what is saved, the fakes), and both entry points
are made from that description. Each family's file holds its spec, its ``Op`` and its ``dispatch``
(``relu_sum.py``, ``invact.py``, ``norms.py``, ``glu.py``; the norm rewrite's Linear ops: ``norm_linear.py``); this
module holds :class:`Op`, the autocast policy, the first-order-only rules and the switch between the two entry
points. The ops receive a spec's key (``modules.spec_of``), never the spec:

    approxbp::relu_sum_forward(x, key, use_triton) → (y, packed codes, NaN bytes)   saves codes + NaN bytes
    approxbp::invact_forward(x, key, use_triton, out_dtype) → (y, branch bits)       saves y + bits (none: monotone)
    approxbp::ms_norm_forward(x, eps, center, use_triton, out_dtype) → (z, σ⁻¹)       saves z + σ⁻¹
    approxbp::glu_forward(g, u, key, use_triton) → act(g)·u                          saves g + u

``use_triton`` picks the generated Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``) or the twin;
``out_dtype`` is the autocast policy (see :func:`autocast_dtype`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from .guards import check_triton_available
from .modules import Spec, register
from .torch_private import forward_ad_active, functorch_derivative_levels, functorch_wrapped

__all__ = ["apply", "as_kernels", "autocast_dtype", "checked_and_registered", "classic", "FIRST_ORDER_ONLY",
           "FirstOrder", "laid_out", "laid_out_like", "needs_grad", "once_differentiable", "Op", "opaque",
           "transformed"]


def checked_and_registered(spec: Spec, use_triton: bool | None) -> Spec:
    """What a drop-in does once, at construction: check that Triton can run when asked to, and register its spec
    (which imported its generated module when it was built, so that no forward pass touches files)."""
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


def laid_out(t: Tensor, strides: tuple[int, ...]) -> Tensor:
    """``t`` with these strides (a copy only where they differ): each op's real output laid out as its fake declares
    and as torch's own op lays it out (``torch.empty_like(x)`` for an elementwise op: x's strides when dense, else
    contiguous), so eager, compiled and stock agree on layout."""
    if t.stride() == tuple(strides) or t.numel() <= 1:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def laid_out_like(t: Tensor, ref: Tensor) -> Tensor:
    """``t`` laid out as ``torch.empty_like(ref)`` (:func:`laid_out`); both contiguous (the common case): ``t``, with
    no meta tensor made on the hot path."""
    if t.is_contiguous() and ref.is_contiguous():
        return t
    return laid_out(t, torch.empty_like(ref, device="meta").stride())


# ---- eager entry points: one autograd.Function per op, custom ops while dynamo traces ---------------------
#: What the drop-ins' autograd supports, said wherever something else is asked of it.
FIRST_ORDER_ONLY = ("approxbp drop-ins support first-order reverse-mode autograd only (loss.backward(), "
                    "torch.autograd.grad, torch.func.grad and jacrev, torch.func.vjp's function called with "
                    "create_graph=False); {what} is refused: their backward is an "
                    "approximation (ReLU-sum, InvAct) or treats σ⁻¹ as a constant (MS-norms), so {why}; "
                    "unpatch the model (approxbp.kernels.unpatch) for {what}")


def _refuse(what: str, why: str):
    raise RuntimeError(FIRST_ORDER_ONLY.format(what=what, why=why))


def transformed(x: Tensor) -> bool:
    """x is inside a torch.func transform or forward-mode AD."""
    return functorch_wrapped(x) or forward_ad_active()


def needs_grad(x: Tensor) -> bool:
    """Whether the call must go through the autograd Function: grad is on and x requires it, or x is inside a
    torch.func transform or forward-mode AD (which the Function then serves or refuses, never the exact twin)."""
    return (x.requires_grad and torch.is_grad_enabled()) or transformed(x)


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


def opaque() -> bool:
    return torch.compiler.is_compiling() or _AS_KERNELS.get()  # in this order: dynamo cannot trace .get()


def once_differentiable(backward):
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
        levels = functorch_derivative_levels()
        under_func = levels or any(functorch_wrapped(r) for r in results)
        if levels > 1 or not under_func:
            _refuse("a second derivative (create_graph=True, nested torch.func.grad)",
                    "a second derivative through it would be wrong")
        return results
    return wrapper


class FirstOrder(torch.autograd.Function):
    """Base of the eager Functions (forward + setup_context, so torch.func.grad and vjp compose; backwards
    :func:`once_differentiable`): forward-mode AD and vmap are refused in one line (:data:`FIRST_ORDER_ONLY`).
    Outside torch.func and forward-mode AD each runs as its :func:`classic` twin (:func:`apply`)."""

    @staticmethod
    def jvp(ctx, *tangents):
        _refuse("forward-mode AD (torch.func.jvp, torch.autograd.forward_ad)",
                "a forward-mode derivative would not match the backward pass")

    @staticmethod
    def vmap(info, in_dims, *args):
        _refuse("torch.func.vmap (and jacrev/jacfwd/hessian, which use it)", "no batching rule is defined")


@functools.cache
def classic(fn: type[FirstOrder]) -> type[torch.autograd.Function]:
    """``fn`` as a classic Function (forward(ctx, …) calling fn's forward and setup_context, fn's backward): for a
    setup_context Function, ``Function.apply`` binds default arguments with ``inspect.signature`` on every call
    (about 50 µs of host time per drop-in per step, benchmarks/host_overhead.py)."""
    def forward(ctx, *args):
        out = fn.forward(*args)
        fn.setup_context(ctx, args, out)
        return out

    return type(f"{fn.__name__}Classic", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(fn.backward)})


def apply(fn: type[FirstOrder], *args):
    """``fn`` applied to ``args``: itself when a tensor among them is inside torch.func or forward-mode AD is on, else
    its classic twin."""
    wrapped = forward_ad_active() or any(functorch_wrapped(a) for a in args)
    return (fn if wrapped else classic(fn)).apply(*args)


def _no_options(*inputs) -> tuple:
    return ()


class Op:
    """One op, described once; from it the eager :class:`FirstOrder` Function (``function``) and, given ``fakes``,
    the custom ops ``approxbp::<name>_forward`` / ``_backward`` (fakes, registered autograd), which save the same
    tensors: the save policy is written in one place.

    - ``forward(*inputs) → output``: tensors, then options of a custom op's argument types (a spec's key, flags,
      dtypes), annotated (the schema is read from them); the output is a tensor, or a tuple whose first tensor alone
      is differentiable (the others are marked non-differentiable).
    - ``saves(inputs, outputs) → tensors`` the backward reads (``outputs`` always a tuple); ``options(*inputs) →``
      the non-tensor values it reads (default none).
    - ``backward([needs,] grad, *saved, *options) → gradient(s)`` of the leading inputs (the rest get None);
      ``needs`` (only with ``masked``, for ops without custom ops): which inputs want a gradient.
    - ``exact``: the backward is made of differentiable ops and may take part in a second derivative; else it is
      :func:`once_differentiable`.
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, *, saves: Callable,
                 options: Callable = _no_options, fakes: tuple[Callable, Callable] | None = None,
                 masked: bool = False, exact: bool = False, function_name: str | None = None):
        if masked and fakes is not None:
            raise ValueError(f"op {name}: a custom op's backward takes no mask of needed gradients")
        self.name, self.forward, self.backward, self.saves, self.options = name, forward, backward, saves, options
        self.masked, self.arity = masked, len(inspect.signature(forward).parameters)
        self.forward_op = self.backward_op = None
        if fakes is not None:
            self.forward_op = torch.library.custom_op(f"approxbp::{name}_forward", forward, mutates_args=())
            self.backward_op = torch.library.custom_op(f"approxbp::{name}_backward", backward, mutates_args=())
            self.forward_op.register_fake(fakes[0])
            self.backward_op.register_fake(fakes[1])
            self.forward_op.register_autograd(self._op_grad, setup_context=self._setup)
        grad = self._grad if exact else once_differentiable(self._grad)
        self.function = type(function_name or f"{name}_function", (FirstOrder,),
                             {"forward": staticmethod(forward), "setup_context": staticmethod(self._setup),
                              "backward": staticmethod(grad), "__doc__": forward.__doc__,
                              "__module__": forward.__module__})

    def __call__(self, *inputs):
        """The op on ``inputs``: its custom op while dynamo traces or within :func:`as_kernels`, else its Function."""
        if self.forward_op is not None and opaque():
            return self.forward_op(*inputs)
        return apply(self.function, *inputs)

    def _setup(self, ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        if len(outputs) > 1:
            ctx.mark_non_differentiable(*outputs[1:])
        ctx.save_for_backward(*self.saves(inputs, outputs))
        ctx.options = self.options(*inputs)

    def _per_input(self, grads) -> tuple:
        grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
        return grads + (None,) * (self.arity - len(grads))

    def _grad(self, ctx, grad, *_):
        mask = (ctx.needs_input_grad,) if self.masked else ()
        return self._per_input(self.backward(*mask, grad, *ctx.saved_tensors, *ctx.options))

    def _op_grad(self, ctx, grad, *_):
        return self._per_input(self.backward_op(grad, *ctx.saved_tensors, *ctx.options))
