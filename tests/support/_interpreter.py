"""A faster ``tl.reduce`` for Triton's CPU interpreter (``TRITON_INTERPRET=1``), installed by tests/conftest.py.

The interpreter runs a reduction whose combine function is not one of Triton's own (max, min, sum, argmax, argmin)
one element at a time in Python: the relu-sum forward's NaN flag, ``tl.reduce(raw, None, _nan_max)``, spent about
90 % of that kernel's interpreted time there (69 of 77 s over 34 tables, cProfile). A combine function must be
associative (what ``tl.reduce`` asks of it; a GPU combines in a tree too), so the same result comes from combining
neighbours pairwise on whole arrays, log₂ n calls instead of n: element 2i with 2i+1, an odd last one carried, the
order of the operands kept. Everything else in the kernel still runs in the interpreter as before.
"""

import numpy as np

__all__ = ["install", "pairwise_reduce"]


def pairwise_reduce(self, input):
    """``ReduceOps.generic_reduce`` by pairwise combination along the axis (None: the flattened tensor)."""
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    rank = input[0].handle.data.ndim
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    while data[0].shape[0] > 1:
        pairs = data[0].shape[0] // 2
        left = [self.to_tensor(d[0:2 * pairs:2], t) for d, t in zip(data, dtypes)]
        right = [self.to_tensor(d[1:2 * pairs:2], t) for d, t in zip(data, dtypes)]
        out = self.combine_fn.fn(*left, *right)
        out = out if isinstance(out, tuple) else (out,)
        combined = [np.broadcast_to(o.handle.data if isinstance(o, tl.core.tensor) else o, d[0:pairs].shape)
                    .astype(d.dtype) for o, d in zip(out, data)]
        data = [np.concatenate([c, d[2 * pairs:]]) for c, d in zip(combined, data)]
    ret = []
    for d, t in zip(data, dtypes):
        d = d[0]
        if self.keep_dims:
            d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * rank)
        elif original_axis is None:
            d = d.item()
        ret.append(self.to_tensor(d, t))
    return ret


def install() -> bool:
    """Use :func:`pairwise_reduce` for the interpreter's generic reductions; False (nothing changed) on a Triton
    whose interpreter has no ``ReduceOps.generic_reduce`` to replace."""
    try:
        from triton.runtime.interpreter import ReduceOps
    except ImportError:
        return False
    if not all(hasattr(ReduceOps, name) for name in ("generic_reduce", "unravel", "to_tensor")):
        return False
    if ReduceOps.generic_reduce is not pairwise_reduce:
        ReduceOps.stock_generic_reduce = ReduceOps.generic_reduce
        ReduceOps.generic_reduce = pairwise_reduce
    return True
