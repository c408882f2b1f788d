#!/usr/bin/env bash
# Session 34, call 6: `megacpp kernels check` on the surfaces with donor peers, after the fixes of
# calls 4-5 (fla's check guard on Hopper with Triton < 3.7.1; mamba_ssm refusing documents),
# carrying .whl.
#   usage: bash benchmarks/results/kernels/h100_s34/call6.sh
set -u
D=$OUT/call6; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site COLUMNS=160
timeout 400 python3 -m megacpp kernels check -s mamba3_scan -s gated_delta \
  -s linear_cross_entropy -s rmsnorm > $D/kernels_check.log 2>&1
echo "kernels check exit $?"; cat $D/kernels_check.log
