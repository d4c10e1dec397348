"""approxbp.kernels exports the drop-ins and patching, not the bit-packing internals (0.1 exported them; 0.2 does
not: CHANGELOG.md)."""

import pytest
import torch


def test_packing_helpers_are_internal_and_reached_only_where_they_live():
    import approxbp.kernels as K
    from approxbp.kernels.ops.packing import pack

    assert "pack" not in K.__all__ and "unpack" not in K.__all__
    with pytest.raises(AttributeError, match="has no attribute 'pack'"):
        K.pack  # noqa: B018 - 0.1's export, removed in 0.2 (CHANGELOG.md)
    bits = torch.tensor([True, False, True, True, False, False, False, True])
    assert int(pack(bits, 1)[0]) == 0b10001101  # little-end first: element j is bit j


@pytest.mark.parametrize("family", ["relu_sum", "invact"])
def test_a_family_name_is_its_function_and_its_module_lives_in_the_run_time(family):
    """``approxbp.kernels.relu_sum`` is the function (0.1 made the module callable; 0.2 dropped that): its module is
    ``approxbp.kernels.ops.relu_sum``, which is not callable."""
    import importlib

    import approxbp.kernels as K

    module = importlib.import_module(f"approxbp.kernels.ops.{family}")
    assert getattr(K, family) is getattr(module, family) and callable(getattr(K, family))
    with pytest.raises(TypeError, match="not callable"):
        module(torch.zeros(1), None)


def test_a_new_spec_family_registers_itself_and_is_rebuilt_from_its_key():
    """One file per family: a Spec subclass with a ``family`` is found by ``spec_of`` without touching a hub."""
    from approxbp.kernels.ops.modules import FAMILIES, SPECS, Spec, spec_of

    class Doubling(Spec):
        family = "test-doubling"

        def __init__(self, factor: str):
            self.key, self.factor = f"{self.family}:{factor}", int(factor)

        @classmethod
        def from_key(cls, rest):
            return cls(rest)

    try:
        assert FAMILIES["test-doubling"] is Doubling
        assert spec_of("test-doubling:3").factor == 3 and "test-doubling:3" in SPECS
        with pytest.raises(KeyError, match="no spec family 'nonesuch'"):
            spec_of("nonesuch:1")
    finally:
        FAMILIES.pop("test-doubling", None)
        SPECS.pop("test-doubling:3", None)
    assert {"relu-sum", "invact", "glu"} <= set(FAMILIES)
