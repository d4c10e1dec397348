"""Discovery: the planner finds a model's norm readers and gated MLPs once, not on every step it measures, and
patches each fresh copy of the model exactly as a discovery of its own would."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _tiny_llm import tiny_llama  # noqa: E402
from approxbp.kernels.rewrite import glu_forms, norm_consumers  # noqa: E402
from approxbp.kernels.rewrite.discovery import Discovery  # noqa: E402
from approxbp.kernels.rewrite.norm_consumers import find_readers  # noqa: E402
from approxbp.kernels.rewrite.patch import patch_model  # noqa: E402


def _inputs(seq: int) -> dict:
    return {"input_ids": torch.arange(2 * seq).reshape(2, seq) % 64}


def _patched(discovery=None, seq=8):
    torch.manual_seed(0)
    model = tiny_llama()
    report = patch_model(model, family=None, example_input=_inputs(seq), check=False, discovery=discovery)
    return model, report


def _counted(monkeypatch, module, name):
    runs, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: runs.append(1) or real(*a))
    return runs


def test_what_patch_model_finds_is_found_once_per_kind_of_model_and_patches_alike(monkeypatch):
    readers = _counted(monkeypatch, norm_consumers, "consumers_by_dispatch")  # llama: fx cannot trace it
    glus = _counted(monkeypatch, glu_forms, "record_calls")
    monkeypatch.setattr("approxbp.kernels.rewrite.glu_patch.record_calls", glu_forms.record_calls)
    discovery = Discovery()
    (alone, report), *shared = [_patched(), *(_patched(discovery) for _ in range(3))]
    assert len(readers) == len(glus) == 2  # the model without a discovery, then the first with it
    assert report.norms and report.glus
    for model, r in shared:
        assert (r.norms, r.glus, r.skipped) == (report.norms, report.glus, report.skipped)
        assert [type(m) for m in model.modules()] == [type(m) for m in alone.modules()]
    found, why = discovery(find_readers, tiny_llama(), _inputs(8))
    assert why is None and found == find_readers(tiny_llama(), _inputs(8))[0]
    found.clear()  # each caller's own copy
    assert discovery(find_readers, tiny_llama(), _inputs(8))[0]
    _patched(discovery, seq=4)  # another input shape: found again (and the readers once more by find_readers above)
    assert (len(readers), len(glus)) == (4, 3)
