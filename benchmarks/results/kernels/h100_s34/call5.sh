#!/usr/bin/env bash
# Session 34, call 5: what makes mamba_ssm's op give NaN on the mamba3_scan check case
# (call 4's `kernels check`), carrying .whl.
#   usage: bash benchmarks/results/kernels/h100_s34/call5.sh
set -u
D=$OUT/call5; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
timeout 400 python3 benchmarks/results/kernels/h100_s34/peer_nan_probe.py 2>&1 | tee $D/peer_nan_probe.log | tail -12
