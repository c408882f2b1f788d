#!/usr/bin/env bash
# Session 22, first device call (carry .whl and .device-carry: b40eae7 and c9af883 unpacked as
# train_step_h100_s17/chain.sh says): the MoE permute-in-the-loads probe, then the MoE, RMSNorm /
# ops and GPU smoke tests, then the training step of b40eae7 (session 21's code), c9af883 (Mamba-3
# on the norm's three copies) and the tree (+ the MoE GEMMs reading x / dout through the plan).
#   usage: bash benchmarks/results/kernels/h100_s22/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/results/kernels/h100_s22/moe_gather_probe.py \
    "$OUT/moe_gather_probe.json" > "$OUT/moe_gather_probe.log" 2>&1
tail -2 "$OUT/moe_gather_probe.log"
bash benchmarks/results/train_step_h100_s17/chain.sh /tmp/ab_s22a b40eae7 c9af883 . \
    -- tests/kernels/test_moe_grouped.py tests/kernels/test_ops_triton.py tests/train/test_gpu_smoke.py
