#!/usr/bin/env bash
# The device run of benchmarks/gpu_kernels.py on a lent GPU (bare image: torch/triton/transformers/peft there;
# approxbp and Liger-Kernel installed from the checkout and carried wheels in .whl/). Usage: bash benchmarks/gpu_run.sh [ARGS]
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
(cd /tmp && python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)")  # not from the checkout, whose kernels/ folder transformers would take for the PyPI package
python3 benchmarks/gpu_kernels.py --out "${OUT:-benchmarks/results}" "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_kernels_log.txt"
