"""The launchers' device guard: a CPU tensor needs the Triton interpreter; a meta tensor passes (nothing runs on it:
``approxbp cost`` records launches with meta tensors), so the guard holds no switch of its own."""

import pytest
import torch
from approxbp.kernels.ops.guards import check_triton_device


def test_a_cpu_tensor_needs_the_interpreter_and_a_meta_tensor_passes(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_triton_device(torch.ones(2))
    check_triton_device(torch.ones(2, device="meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_triton_device(torch.ones(2))
