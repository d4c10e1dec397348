import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import: kernels run on the CPU
# One OpenMP thread in every process a test starts (notebook kernels, the CLI, benchmark scripts), as the xdist
# workers set for themselves below: two threads of a subprocess beside two busy workers wait on each other at every
# parallel region, and the BDIA notebook took 202 s beside one busy core where it takes 25 s with one thread. numpy's
# and scipy's OpenBLAS read it too: each worker ran two BLAS threads before.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
# Python started by a test (`-c`, `-m`, a notebook kernel) puts no working directory on sys.path: from the repository
# root that would make kernels/ importable as a second, top-level package `kernels`.
os.environ["PYTHONSAFEPATH"] = "1"
sys.path.insert(0, str(Path(__file__).parent / "support"))  # the helpers the test files share (_helpers, _accuracy)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")

#: Set to 1 to run the tests marked slow too; .ci/run sets it, so CI runs everything.
ALL_TESTS = "APPROXBP_ALL_TESTS"


def pytest_configure(config):
    _refuse_a_second_kernels_package()
    config.addinivalue_line("markers", "slow: over ~5 s on 2 cores, or sharing a fixture with such a test; skipped "
                            f"unless {ALL_TESTS}=1 (CI sets it)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        import _interpreter

        _interpreter.install()  # reductions with our own combine functions pairwise, not element by element
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: the workers already fill the cores
        import torch

        torch.set_num_threads(1)


def _refuse_a_second_kernels_package():
    """The source folders are packages only under ``approxbp.`` (pyproject's package-dir); with the repository root
    on sys.path (``python -m pytest`` run there) kernels/ would also be found as ``kernels``, a second copy that
    registers every custom op again (transformers imports ``kernels`` to probe for HF's kernel hub)."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin and Path(spec.origin).parent == Path(__file__).parent.parent / "kernels":
        raise pytest.UsageError("the repository root is on sys.path, so kernels/ is importable as a top-level "
                                "`kernels`: run the tests with `pytest` (or `python -P -m pytest`), not "
                                "`python -m pytest`")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ALL_TESTS) == "1" or config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason=f"slow; CI runs it ({ALL_TESTS}=1 pytest runs everything)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gelu():
    from approxbp.approximations import get_activation

    return get_activation("gelu")
