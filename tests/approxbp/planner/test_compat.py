"""The functions the planner replaces while it measures exist in the installed torch and transformers, are
replaced within and restored after (an error included), and a missing one is refused by name."""

import types

import pytest
import torch.nn.functional as F

from approxbp.planner.compat import swapped, unpacked_sequences


def test_each_replaced_function_exists_here():
    assert callable(F.scaled_dot_product_attention) and callable(F.dropout)
    masks = pytest.importorskip("transformers.masking_utils")
    assert callable(masks.find_packed_sequence_indices)


def test_swapped_replaces_within_and_restores_after_an_error():
    owner = types.SimpleNamespace(f=len)
    with pytest.raises(KeyError), swapped(owner, "f", abs):
        assert owner.f is abs
        raise KeyError
    assert owner.f is len


def test_a_function_gone_from_the_library_is_refused_by_name():
    owner = types.ModuleType("somelib")
    with pytest.raises(AttributeError, match="somelib.renamed is gone"), swapped(owner, "renamed", abs):
        pass


def test_unpacked_sequences_answers_none_where_transformers_would_look():
    torch = pytest.importorskip("torch")
    masks = pytest.importorskip("transformers.masking_utils")
    packed = torch.tensor([[0, 1, 2, 0, 1]])  # two sequences packed in one row
    assert masks.find_packed_sequence_indices(packed) is not None
    with unpacked_sequences():
        assert masks.find_packed_sequence_indices(packed) is None
    assert masks.find_packed_sequence_indices(packed) is not None
