"""Launch settings of the element-wise kernels (generated ReLU-sum and InvAct, BDIA): one home, used by the
launchers, so the tests that run every kernel under the interpreter run them with exactly these settings.

These are static (not autotuned): the NaN bytes need fixed program spans. ``approxbp cost`` compiles every kernel
with them for sm_90; ``benchmarks/gpu_kernels.py`` measures them on a GPU.
"""

from __future__ import annotations

import torch

__all__ = ["BIT_BLOCK_BYTES", "ELEMENT_BLOCK", "GLU_BLOCK", "num_warps", "RELU_SUM_ROWS", "RELU_SUM_SPAN"]


#: Elements per program of the ReLU-sum kernels, for every k: also the span of one saved NaN byte.
RELU_SUM_SPAN = 4096
#: Bytes of packed bits per program of the InvAct and BDIA kernels (8 elements per byte: 4096 elements).
BIT_BLOCK_BYTES = 512


#: Elements per program of the kernels that save no bits (a monotone InvAct table's), as the others' 4096.
ELEMENT_BLOCK = 4096


#: Rows of 8 elements per ReLU-sum program (``ROWS`` of the generated kernels); a thread packs whole rows.
RELU_SUM_ROWS = RELU_SUM_SPAN // 8


def num_warps(dtype: torch.dtype) -> int:
    """Warps per program of every element-wise kernel (4096 elements): 4 for 16-bit data (32 elements, 64 bytes
    per thread), 8 for 32/64-bit (16 per thread; 4 warps spill the InvAct backward's registers in fp32)."""
    return 4 if dtype.itemsize <= 2 else 8


#: Elements per program of the fused GLU kernels (as the other element-wise kernels' 4096).
GLU_BLOCK = 4096
