"""Small helpers several test files share: a packaged table's raw JSON, writing one to a temporary file, saving and
exporting a user's table (what a user runs before training), the exact float64 gradient of GELU/SiLU, and SGD steps
that train two models alike."""

import json
import os
from pathlib import Path

import torch
from approxbp.approximations import tables as table_files

#: The repository root (tests/ mirrors its source folders).
ROOT = Path(__file__).resolve().parents[2]


def table_json(name: str) -> dict:
    """A packaged table as its raw JSON object (to be mutated by a test)."""
    return json.loads(table_files.resolve(name).read_text())


def write_json(tmp_path: Path, t: dict, name: str = "t.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(t))
    return p


def exported(table, path: Path, out_dir: Path | None = None) -> Path:
    """Save ``table`` (typed or JSON) at ``path`` and generate its kernels, as `approxbp export` does: the drop-ins
    then take ``str(path)`` (with ``kernels_dir=out_dir`` when given)."""
    from approxbp.kernels.codegen import export

    path = table_files.save(table, path)
    export([path], out_dir)
    return path


def exact_grad(x: torch.Tensor, act: str) -> torch.Tensor:
    """d/dx of sum(f(x)) in float64 through torch's own GELU/SiLU."""
    xd = x.double().detach().requires_grad_(True)
    f = torch.nn.functional.gelu if act == "gelu" else torch.nn.functional.silu
    f(xd).sum().backward()
    return xd.grad


def skips_only_returned_norms(report) -> bool:
    """Only a norm whose output the model returns (the final norm is the last hidden state) was skipped."""
    return len(report.skipped) <= 1 and all("returned as a model output" in s for s in report.skipped)


def sgd_steps(model: torch.nn.Module, x: torch.Tensor, steps: int = 3, lr: float = 0.1) -> torch.nn.Module:
    """``steps`` plain SGD steps on mean(model(x)²), in place: two models trained alike from the same weights."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model


def python_path(*folders: Path) -> str:
    """PYTHONPATH for a Python a test starts: ``folders``, then the caller's PYTHONPATH, never an empty entry. An empty
    entry is the working directory, which PYTHONSAFEPATH does not drop: from the repository root kernels/ would then
    shadow Hugging Face's ``kernels``, which transformers ≥ 5.25 installs and imports (CI at stop 76)."""
    entries = [*map(str, folders), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(e for e in entries if e)
