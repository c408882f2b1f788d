#!/usr/bin/env bash
# Session 20, first device call (working tree; carry .whl and .device-carry): the Mamba-3 GPU
# tests, the fuse_dx probe, then the training step of 5885b98 (the session's start) and of the
# tree, each in its own process.   usage: bash benchmarks/results/kernels/h100_s20/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=$OUT/s20_call1; mkdir -p "$D"
python3 -m pytest -q -rf -m gpu tests/kernels/test_mamba3_triton.py > "$D/gpu_tests_mamba3.log" 2>&1
tail -3 "$D/gpu_tests_mamba3.log"
python3 benchmarks/results/kernels/h100_s20/mamba3_fuse_probe.py "$D" 2>&1 | tee "$D/mamba3_fuse_probe.log"
bash benchmarks/results/train_step_h100_s17/chain.sh /tmp/ab_s20a 5885b98 .
