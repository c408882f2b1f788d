#!/usr/bin/env bash
# Session 27, sixth device call (carry .whl as in call1.sh): the GPU smoke tests under fast
# kernels on the final tree again (call 5's hit its 120 s timeout after the first test passed).
#   usage: bash benchmarks/results/train_h100_s27/call6.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
D=/tmp/s27_call6; mkdir -p $D
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 300 python3 -m pytest -q -rf --durations=5 \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -9 $D/gpu_smoke_fast.log
tar czf "$OUT/s27_call6.tgz" -C /tmp s27_call6
