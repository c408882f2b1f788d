#!/usr/bin/env bash
# Session 23, second device call (carry .whl and .device-carry with 2750153 unpacked): the MoE
# bench rows (benchmarks/kernels.py --surfaces moe_experts: per call and CUDA-graph replay, the
# per-expert loop and one dense GEMM of the same FLOPs) of 2750153 and of the tree (gate|up with
# the SwiGLU in its epilogue at the bench's shapes too), alternately, twice each; then the MoE
# GPU tests and the offline compile tests.   usage: bash benchmarks/results/kernels/h100_s23/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s23_call2; mkdir -p $D
for run in 1 2; do
    for T in 2750153 tree; do
        src=$PWD/src; [ $T != tree ] && src=$PWD/.device-carry/s17/$T/src
        PYTHONPATH=$src:$PWD:/tmp/site python3 benchmarks/kernels.py --surfaces moe_experts \
            --name moe_${T}_run$run --out $D/moe_${T}_run$run > $D/moe_${T}_run$run.log 2>&1
        echo "== $T run $run"; grep -E "^moe_experts" $D/moe_${T}_run$run.log | cut -c1-150
    done
done
PYTHONPATH=$PWD/src:$PWD:/tmp/site python3 -m pytest -q -rf tests/kernels/test_moe_grouped.py \
    tests/model/test_moe.py tests/kernels/test_triton_compile.py > $D/gpu_tests.log 2>&1
tail -3 $D/gpu_tests.log
tar czf "$OUT/s23_call2.tgz" -C /tmp s23_call2
