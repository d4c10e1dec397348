"""NormReaders: the planner finds a model's norm readers once, not on every step it measures, and patches each
fresh copy of the model exactly as a discovery of its own would."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_llm import tiny_llama  # noqa: E402
from approxbp.kernels.rewrite import norm_consumers  # noqa: E402
from approxbp.kernels.rewrite.norm_consumers import NormReaders, find_readers  # noqa: E402
from approxbp.kernels.rewrite.patch import patch_model  # noqa: E402


def _inputs(seq: int) -> dict:
    return {"input_ids": torch.arange(2 * seq).reshape(2, seq) % 64}


def _patched(readers=None):
    torch.manual_seed(0)
    model = tiny_llama()
    report = patch_model(model, family=None, example_input=_inputs(8), check=False, glu=False, norm_readers=readers)
    return model, report


def test_readers_are_found_once_per_kind_of_model_and_patch_as_their_own_discovery(monkeypatch):
    runs = []
    real = norm_consumers.consumers_by_dispatch
    monkeypatch.setattr(norm_consumers, "consumers_by_dispatch", lambda *a: runs.append(1) or real(*a))
    readers = NormReaders()
    (alone, report), *shared = [_patched(), *(_patched(readers) for _ in range(3))]
    assert len(runs) == 2  # the model without the memo, then the first with it: llama runs (fx cannot trace it)
    assert report.norms and all(r.norms == report.norms and r.skipped == report.skipped for _, r in shared)
    for model, _ in shared:
        assert [type(m) for m in model.modules()] == [type(m) for m in alone.modules()]
    found, why = readers(tiny_llama(), _inputs(8))
    assert why is None and found == find_readers(tiny_llama(), _inputs(8))[0]
    found.clear()  # each caller's own copy
    assert readers(tiny_llama(), _inputs(8))[0]
    readers(tiny_llama(), _inputs(4))  # another input shape: found again
    assert len(runs) == 4
