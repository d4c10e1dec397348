#!/usr/bin/env bash
# The device run of benchmarks/gpu_kernels.py on a GPU machine whose Python has torch, triton, transformers and peft:
# approxbp is installed from the checkout, and any wheels in .whl/ with it (Liger-Kernel for the comparison rows:
# `pip download --no-deps -d .whl liger-kernel` on a machine with the registry). Usage: bash benchmarks/gpu_run.sh [ARGS]
set -o pipefail
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
(cd /tmp && python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)")  # not from the checkout, whose kernels/ folder transformers would take for the PyPI package
python3 benchmarks/gpu_kernels.py --out "${OUT:-benchmarks/results}" "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_kernels_log.txt"
