"""A JSON value computed once per test run, however many xdist workers ask for it (the pytest-xdist recipe: a file
beside the workers' own temporary folders, under a file lock). A module-scoped fixture is not enough under
``--dist worksteal``: a worker that leaves a module and comes back to it sets the fixture up again (CI's model-
coverage rows, 5 min each, were measured three times in one run)."""

import json
import os

from filelock import FileLock


def once_per_run(tmp_path_factory, name: str, compute):
    """``compute()`` (a JSON value) once per ``pytest`` run; each caller gets it read back from JSON. Without xdist
    there is one process and nothing to share."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return json.loads(json.dumps(compute()))
    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"  # the run's folder, above each worker's own
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
