"""The library functions the planner replaces while it measures, in one place, each by name: a renamed one is an
error that names it, never a silently different number (``tests/approxbp/planner/test_compat.py`` checks each
against the installed torch and transformers).

- ``torch.nn.functional.scaled_dot_product_attention`` and ``torch.nn.functional.dropout``: kept as a GPU keeps
  them (:mod:`~.attention`);
- ``transformers.masking_utils.find_packed_sequence_indices``: on fake tensors transformers treats every tensor as
  traced and skips this check, then materialises a causal mask that a real run of unpacked inputs never builds
  (:func:`unpacked_sequences`)."""

from __future__ import annotations

import contextlib
import importlib

__all__ = ["swapped", "unpacked_sequences"]


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """Within: ``owner.name`` is ``value`` (restored on exit, also after an error). An owner without ``name`` is
    refused by name: the planner's numbers depend on the replacement taking effect."""
    if not hasattr(owner, name):
        raise AttributeError(f"{getattr(owner, '__name__', owner)}.{name} is gone from this version: approxbp's "
                             "planner replaces it while it measures (approxbp/planner/compat.py)")
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def unpacked_sequences():
    """Within: transformers' check for packed sequences answers "none" (the inputs the planner builds are never
    packed), as a real run finds; with a transformers that has no ``masking_utils`` (older), nothing to do."""
    try:
        masks = importlib.import_module("transformers.masking_utils")
    except ImportError:
        yield
        return
    with swapped(masks, "find_packed_sequence_indices", lambda position_ids: None):
        yield
