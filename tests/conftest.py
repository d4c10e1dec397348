import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import: kernels run on the CPU

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def gelu():
    from approxbp.approximations import get_activation

    return get_activation("gelu")
