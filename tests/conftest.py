import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import: kernels run on the CPU
sys.path.insert(0, str(Path(__file__).parent))  # tests/ mirrors the source folders; their files share _helpers

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")

#: Set to 1 to run the tests marked slow too; .ci/run sets it, so CI runs everything.
ALL_TESTS = "APPROXBP_ALL_TESTS"


def pytest_configure(config):
    config.addinivalue_line("markers", f"slow: over ~20 s on 2 cores; skipped unless {ALL_TESTS}=1 (CI sets it)")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: the workers already fill the cores
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ALL_TESTS) == "1" or config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason=f"slow; CI runs it ({ALL_TESTS}=1 python -m pytest runs everything)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gelu():
    from approxbp.approximations import get_activation

    return get_activation("gelu")
