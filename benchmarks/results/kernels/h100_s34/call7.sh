#!/usr/bin/env bash
# Session 34, call 7: `megacpp kernels check` on every surface (bf16, the GPU default), carrying
# .whl (the peers).
#   usage: bash benchmarks/results/kernels/h100_s34/call7.sh
set -u
D=$OUT/call7; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site COLUMNS=160
timeout 540 python3 -m megacpp kernels check > $D/kernels_check.log 2>&1
echo "kernels check exit $?"; cat $D/kernels_check.log
