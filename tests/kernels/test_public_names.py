"""approxbp.kernels exports the drop-ins and patching, not the bit-packing internals (still reachable, with a
deprecation warning, from where 0.1 exported them)."""

import pytest
import torch


def test_packing_helpers_are_internal_and_the_old_names_warn():
    import approxbp.kernels as K
    from approxbp.kernels.packing import pack

    assert "pack" not in K.__all__ and "unpack" not in K.__all__
    with pytest.warns(DeprecationWarning, match="approxbp.kernels.packing"):
        old = K.pack
    assert old is pack
    bits = torch.tensor([True, False, True, True, False, False, False, True])
    assert int(old(bits, 1)[0]) == 0b10001101  # little-end first: element j is bit j
