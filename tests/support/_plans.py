"""One plan (or compiled point) per distinct step per test process: the Trainer tests plan the same tiny model under
the same budget again and again (a budgeted plan: 5–15 s on 2 cores), and the compile tests compile the same
assignment at the same ``activation_memory_budget`` in a fixture and again in a test (2–8 s each).
``share_plans(monkeypatch)`` makes ``approxbp.planner.plan.plan`` plan each distinct request once (keyed by the
config file's and the user's tables' contents, not their temporary paths) and hand each caller its own deep copy;
``share_points(monkeypatch)`` does the same for ``approxbp.planner.compiled.point`` (what ``points``, ``plan`` and
``pareto`` call for each compiled budget). Both are pure functions of their arguments: a test that checks that two
runs agree calls the real one. Given pytest's ``tmp_path_factory``, a result is also shared between the run's xdist
workers (pickled beside their temporary folders, under a lock per key): in one run of the Trainer and compile tests
both workers compiled the same nine points and planned the same budget. A worker that asks while another computes
the same key waits for it (no core is saved then; one that asks later reads it)."""

import copy
import dataclasses
import hashlib
from pathlib import Path

from _once import once_per_run

_PLANS: dict = {}
_POINTS: dict = {}


def _contents(path: str) -> str:
    """A file's contents (the key of a temporary copy), else the string itself (a model type with overrides, which
    may be longer than a file name may be: no file)."""
    p = Path(path)
    try:
        return p.read_text() if p.is_file() else path
    except OSError:  # ENAMETOOLONG
        return path


def share_calls(monkeypatch, module, name: str, store: dict, key, tmp_path_factory=None) -> None:
    """``module.name`` computes each distinct ``key(*args, **options)`` once into ``store`` (and, with
    ``tmp_path_factory`` under xdist, once per run) and hands each caller its own deep copy; a key of None calls the
    real function."""
    real = getattr(module, name)

    def shared(*args, **options):
        k = key(*args, **options)
        if k is None:  # not a pure function of its arguments this time
            return real(*args, **options)
        if k not in store:
            if tmp_path_factory is None:
                store[k] = real(*args, **options)
            else:
                tag = f"{name}-{hashlib.sha256(repr(k).encode()).hexdigest()[:24]}"
                store[k] = once_per_run(tmp_path_factory, tag, lambda: real(*args, **options), pickled=True)
        return copy.deepcopy(store[k])

    monkeypatch.setattr(module, name, shared)


def _request_key(request) -> str:
    return repr(dataclasses.replace(request, model=_contents(request.model),
                                    tables=tuple(_contents(t) for t in request.tables)))


def share_plans(monkeypatch, tmp_path_factory=None) -> None:
    from approxbp.planner import plan as planner

    share_calls(monkeypatch, planner, "plan", _PLANS,
                lambda request, **options: (_request_key(request), repr(sorted(options.items()))), tmp_path_factory)


def share_points(monkeypatch, tmp_path_factory=None) -> None:
    from approxbp.planner import compiled

    def key(request, device, choice, ms_norm, budget, blocks=None, watch=None):  # a watching mode sees a real run
        if watch is not None:
            return None
        return _request_key(request), repr(device), repr(sorted(choice.items())), ms_norm, budget, blocks

    share_calls(monkeypatch, compiled, "point", _POINTS, key, tmp_path_factory)
