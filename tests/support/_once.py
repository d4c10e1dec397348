"""A JSON (or pickled) value computed once per test run, however many xdist workers ask for it (the pytest-xdist
recipe: a file beside the workers' own temporary folders, under a file lock). A module-scoped fixture is not
enough under ``--dist worksteal``: a worker that leaves a module and comes back to it sets the fixture up again
(CI's model-coverage rows, 5 min each, were measured three times in one run)."""

import json
import os
import pickle

from filelock import FileLock


def once_per_run(tmp_path_factory, name: str, compute, pickled: bool = False):
    """``compute()`` (a JSON value; with ``pickled``, any picklable one) once per ``pytest`` run; each caller gets it
    read back from its file. Without xdist there is one process and nothing to share (a JSON value is still read
    back through JSON, so both ways give the same types)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        value = compute()
        return value if pickled else json.loads(json.dumps(value))
    path = tmp_path_factory.getbasetemp().parent / f"{name}.{'pickle' if pickled else 'json'}"  # the run's folder
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            value = compute()
            path.write_bytes(pickle.dumps(value)) if pickled else path.write_text(json.dumps(value))
        return pickle.loads(path.read_bytes()) if pickled else json.loads(path.read_text())
