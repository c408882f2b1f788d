#!/usr/bin/env bash
# Session 22, fourth device call (carry .whl and .device-carry with c9af883 unpacked): the
# training step at the tree, hybrid and dense Llama in one process (final.sh's first run, no
# profile); then the expert-GEMM GPU tests and the step of c9af883 and of the tree (the SwiGLU
# epilogue at 8 warps) once more.   usage: bash benchmarks/results/kernels/h100_s22/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/final_s22; mkdir -p "$D"
A="--preset nam56r-350m --seq-len 2048 --kernels fast"
python3 benchmarks/train_step.py $A --models hybrid llama --modes compiled compiled-graphed \
    --out "$D/final_s22.json" > "$D/final_s22.log" 2>&1; grep "L=2048" "$D/final_s22.log"
tar czf "$OUT/final_s22.tgz" -C /tmp final_s22
bash benchmarks/results/train_step_h100_s17/chain.sh /tmp/ab_swiglu_w8 c9af883 . \
    -- tests/kernels/test_moe_grouped.py -k "grouped_mm or cuda_matches"
