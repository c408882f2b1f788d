#!/usr/bin/env bash
# Session 23, third device call (carry .whl): the GPU tests of what the session touched, at
# its final tree (after the lint fixes and the SwiGLU-epilogue test at every shape it serves),
# and the offline sm_90 compile tests.   usage: bash benchmarks/results/kernels/h100_s23/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
D=/tmp/s23_call3; mkdir -p $D
git rev-parse HEAD > $D/commit.txt 2>/dev/null; git status --short >> $D/commit.txt 2>/dev/null
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
# the GPU tests of what the session touched (the whole GPU suite ran past 8 minutes: its
# first run, call3/gpu_tests_all_timed_out.log, passed 55 before the timeout stopped it)
timeout 480 python3 -m pytest -q -rfs -m gpu --durations=8 tests/kernels/test_moe_grouped.py \
    tests/model/test_mamba3.py tests/contract/test_contract_gpu.py tests/train/test_gpu_smoke.py \
    tests/train/test_cuda_graph.py > $D/gpu_tests.log 2>&1
tail -15 $D/gpu_tests.log
python3 -m pytest -q tests/kernels/test_triton_compile.py > $D/compile_tests.log 2>&1
tail -2 $D/compile_tests.log
tar czf "$OUT/s23_call3.tgz" -C /tmp s23_call3
