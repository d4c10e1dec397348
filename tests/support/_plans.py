"""One plan per distinct step per test process: the Trainer tests plan the same tiny model under the same budget
again and again (a budgeted plan: 5–15 s on 2 cores). ``share_plans(monkeypatch)`` makes
``approxbp.planner.plan.plan`` plan each distinct request once (keyed by the config file's and the user's tables'
contents, not their temporary paths) and hand each caller its own deep copy."""

import copy
import dataclasses
from pathlib import Path

_PLANS: dict = {}


def share_plans(monkeypatch) -> None:
    from approxbp.planner import plan as planner

    real = planner.plan

    def plan(request, **options):
        contents = dataclasses.replace(request, model=Path(request.model).read_text(),
                                       tables=tuple(Path(t).read_text() for t in request.tables))
        key = (repr(contents), repr(sorted(options.items())))
        if key not in _PLANS:
            _PLANS[key] = real(request, **options)
        return copy.deepcopy(_PLANS[key])

    monkeypatch.setattr(planner, "plan", plan)
