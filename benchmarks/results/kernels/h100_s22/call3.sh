#!/usr/bin/env bash
# Session 22, third device call (carry .whl and .device-carry with c9af883 unpacked): the SwiGLU
# epilogue probe, the MoE GPU tests and the GPU smoke tests, then the training step of c9af883
# (Mamba-3 on the norm's three copies) and of the tree (+ the MoE's gate|up GEMM with the
# SwiGLU in its epilogue), alternately, twice each.
#   usage: bash benchmarks/results/kernels/h100_s22/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/results/kernels/h100_s22/swiglu_epilogue_probe.py \
    "$OUT/swiglu_epilogue_probe.json" > "$OUT/swiglu_epilogue_probe.log" 2>&1
cat "$OUT/swiglu_epilogue_probe.log" | cut -c1-200
bash benchmarks/results/train_step_h100_s17/chain.sh /tmp/ab_swiglu c9af883 . c9af883 . \
    -- tests/kernels/test_moe_grouped.py tests/model/test_moe.py tests/train/test_gpu_smoke.py
