"""The toy family's generated Triton module: forward y = h(x) and one byte s = [x < 0] per element; backward
dx = dy · (a if s else b). With its PyTorch twin (h, for CPU tensors and as the kernels' oracle)."""

from __future__ import annotations

from pathlib import Path

from approxbp.approximations import get_activation
from approxbp.approximations.families import register
from approxbp.kernels.codegen.helpers import import_helpers
from approxbp.kernels.codegen.printer import triton_source
from approxbp.kernels.codegen.registry import RENDERERS
from approxbp.kernels.codegen.twins import (
    ACTIVATION_TEMPLATE,
    HEADER_TEMPLATE,
    activation_twin,
    identity,
    twins_section,
)

from .table import FAMILY

TEMPLATE = HEADER_TEMPLATE + '''\
LEVELS = {levels!r}
''' + ACTIVATION_TEMPLATE + '''

@triton.jit
def forward_kernel(x_ptr, y_ptr, s_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask)
    y = activation(x.to(tl.float32), x.dtype != tl.float32 and x.dtype != tl.float64)
    tl.store(y_ptr + i, y.to(x.dtype), mask=mask)
    tl.store(s_ptr + i, (x < 0.0).to(tl.uint8), mask=mask)


@triton.jit
def backward_kernel(g_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    g = tl.load(g_ptr + i, mask=mask)
    s = tl.load(s_ptr + i, mask=mask)
    dx = g.to(tl.float32) * tl.where(s != 0, {a!r}, {b!r})
    tl.store(out_ptr + i, dx.to(g.dtype), mask=mask)
'''


def render(table_path: Path, t) -> str:
    act = get_activation(t.expression)
    source = triton_source(act.expr, lowp=True)
    doc = repr(f"{t.activation} toy step: saves one byte [x < 0] per element; dx = dy · {t.levels}.")
    a, b = t.levels
    return (TEMPLATE.format(docstring=doc, **identity(table_path, t), levels=list(t.levels), a=a, b=b,
                            helpers=import_helpers(source), source=source)
            + twins_section(activation_twin(act, 0, "activation_twin")))


register(RENDERERS, FAMILY, render)
