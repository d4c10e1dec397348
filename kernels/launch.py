"""Launch settings of the generated element-wise kernels: one home, used by the launchers and by the test that
runs every kernel under the interpreter with exactly these settings.

No GPU has been lent to the sessions that chose these values, so they are starting points, not tuned results:
``benchmarks/gpu_kernels.py`` sweeps ``NUM_WARPS_CANDIDATES`` on a GPU and reports the fraction of copy bandwidth.
"""

from __future__ import annotations

import torch

#: Elements per program of the ReLU-sum kernels, for every k: also the span of one saved NaN byte.
RELU_SUM_SPAN = 4096
NUM_WARPS_CANDIDATES = (2, 4, 8)


def relu_sum_words(storage_bits: int) -> int:
    """int32 words of codes per program (``WORDS`` of the generated kernels): RELU_SUM_SPAN codes."""
    return RELU_SUM_SPAN * storage_bits // 32


def num_warps(dtype: torch.dtype) -> int:
    """Warps per program: 4 for 16-bit data (4096 elements = 8 KiB), 8 for 32/64-bit."""
    return 4 if dtype.itemsize <= 2 else 8
