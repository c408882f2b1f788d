#!/usr/bin/env bash
# Session 23, third device call (carry .whl): every GPU-marked test at the session's final tree
# (after the lint fixes and the SwiGLU-epilogue test at every shape it serves), and the
# offline sm_90 compile tests.   usage: bash benchmarks/results/kernels/h100_s23/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
D=/tmp/s23_call3; mkdir -p $D
git rev-parse HEAD > $D/commit.txt 2>/dev/null; git status --short >> $D/commit.txt 2>/dev/null
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
# (modules whose imports the GPU machine lacks -- fastapi, megatron-core -- fail to collect)
timeout 480 python3 -m pytest -q -rfs -m gpu --continue-on-collection-errors tests > $D/gpu_tests.log 2>&1
tail -15 $D/gpu_tests.log
python3 -m pytest -q tests/kernels/test_triton_compile.py > $D/compile_tests.log 2>&1
tail -2 $D/compile_tests.log
tar czf "$OUT/s23_call3.tgz" -C /tmp s23_call3
