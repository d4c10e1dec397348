"""The step-time calibration script: every code path on the CPU (--smoke), and a refusal without CUDA."""

import json
import subprocess
import sys

import pytest
import torch
from _helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_step_time.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script really measures")
def test_refuses_without_cuda(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "no CUDA device" in run.stderr and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_smoke_models_every_setup_and_writes_no_time(tmp_path):
    """The five set-ups are built, moved and modelled (the offloaded one charged its host copies on top), and run
    on the CPU; a CPU time is never written as a GPU one."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["setup"] for r in rows] == ["exact", "glu+ms-norm", "glu+ms-norm, every block recomputed",
                                          "glu+ms-norm, every block offloaded", "glu+ms-norm, loss chunked"]
    assert all(r["modelled_ms"] > 0 and "measured_median_ms" not in r for r in rows)
    fused, recomputed, offloaded = (rows[i]["modelled_ms"] for i in (1, 2, 3))
    assert recomputed > fused and offloaded > fused and not list(tmp_path.iterdir())
