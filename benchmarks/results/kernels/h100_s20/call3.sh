#!/usr/bin/env bash
# Session 20, third device call (carry .whl and .device-carry): the Mamba-3 kernels' times of
# 5885b98 and of the working tree, alternately, twice each; then the Mamba-3 GPU tests.
#   usage: bash benchmarks/results/kernels/h100_s20/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=$OUT/s20_call3; mkdir -p "$D"
P=benchmarks/results/kernels/h100_s20/mamba3_kernel_times.py
for i in 1 2; do
    PYTHONPATH=$PWD/.device-carry/s17/5885b98/src:/tmp/site python3 $P "$D/kernel_times.jsonl" 5885b98 2>&1 | grep -v Warn
    PYTHONPATH=$PWD/src:/tmp/site python3 $P "$D/kernel_times.jsonl" tree 2>&1 | grep -v Warn
done
PYTHONPATH=$PWD/src:$PWD:/tmp/site python3 -m pytest -q -rf -m gpu tests/kernels/test_mamba3_triton.py > "$D/gpu_tests_mamba3.log" 2>&1
tail -3 "$D/gpu_tests_mamba3.log"
