"""Launch settings of the element-wise kernels (generated ReLU-sum and InvAct, BDIA): one home, used by the
launchers, so the tests that run every kernel under the interpreter run them with exactly these settings.

No GPU has been lent to the sessions that chose these values: they are starting points, not tuned results
(``benchmarks/gpu_kernels.py`` reports each kernel's fraction of copy bandwidth on a GPU).
"""

from __future__ import annotations

import torch

#: Elements per program of the ReLU-sum kernels, for every k: also the span of one saved NaN byte.
RELU_SUM_SPAN = 4096
#: Bytes of packed bits per program of the InvAct and BDIA kernels (8 elements per byte: 2048 elements).
BIT_BLOCK_BYTES = 256


def relu_sum_words(storage_bits: int) -> int:
    """int32 words of codes per program (``WORDS`` of the generated kernels): RELU_SUM_SPAN codes."""
    return RELU_SUM_SPAN * storage_bits // 32


def num_warps(dtype: torch.dtype) -> int:
    """Warps per program: 4 for 16-bit data (4096 elements = 8 KiB), 8 for 32/64-bit."""
    return 4 if dtype.itemsize <= 2 else 8
