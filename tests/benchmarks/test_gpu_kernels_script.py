"""The GPU benchmark script exists, parses, and refuses to time anything without CUDA."""

import subprocess
import sys

import pytest
import torch
from _helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the scripts really measure")
@pytest.mark.parametrize("script", ["gpu_kernels.py", "gpu_profile.py"])
def test_refuses_without_cuda(tmp_path, script):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no CUDA device" in run.stderr
    assert not list(tmp_path.iterdir())


def test_help_lists_the_options():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--numel" in run.stdout and "--dtype" in run.stdout


@pytest.mark.slow
def test_smoke_run_exercises_every_section_on_the_cpu(tmp_path):
    """Every code path of the GPU script (kernels vs eager/compile, compiled backward, training steps in the three
    modes, ViT-B LoRA) on tiny CPU tensors, so that a crash cannot wait for a lent GPU to show. Writes nothing."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "every section ran (0 implementation(s) failed)" in run.stdout
    assert not list(tmp_path.iterdir())


PROFILE = ROOT / "benchmarks" / "gpu_profile.py"



@pytest.mark.slow
def test_the_profile_smoke_run_exercises_both_sections_on_the_cpu(tmp_path):
    """Kernels alone vs through autograd (every drop-in's spec called directly), and the profiled ViT-B LoRA step
    of each variant, on tiny CPU tensors. Writes nothing."""
    run = subprocess.run([sys.executable, str(PROFILE), "--smoke", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "every section ran" in run.stdout
    assert not list(tmp_path.iterdir())
