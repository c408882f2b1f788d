#!/usr/bin/env bash
# Session 23, fourth device call (carry .whl): every GPU-marked test at the session's final
# tree, in two halves across two calls (together they run past one call's 10 minutes).
#   usage: bash benchmarks/results/kernels/h100_s23/call4.sh kernels|rest
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
D=/tmp/s23_call4_$1; mkdir -p $D
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
if [ "$1" = kernels ]; then paths=(tests/kernels); else
    paths=(tests --ignore=tests/kernels); fi
# (modules whose imports the GPU machine lacks -- fastapi, megatron-core -- fail to collect)
timeout 560 python3 -m pytest -q -rfs -m gpu --continue-on-collection-errors --durations=10 \
    "${paths[@]}" > $D/gpu_tests.log 2>&1
tail -25 $D/gpu_tests.log | grep -v "^  \|Warning\|warn"
tar czf "$OUT/s23_call4_$1.tgz" -C /tmp s23_call4_$1
