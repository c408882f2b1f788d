#!/usr/bin/env bash
# Session 23, first device call (carry .whl and .device-carry with 2750153 unpacked): the SwiGLU
# fusion probe (backward and forward settings at the step's and the bench's shapes), the MoE
# GPU tests and the offline compile tests, then the training step of 2750153 (session 22's
# end) and of the tree (d hidden with the SwiGLU's backward in its epilogue, 128 x 64, 8 warps).
#   usage: bash benchmarks/results/kernels/h100_s23/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s23_call1; mkdir -p $D
PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/results/kernels/h100_s23/swiglu_fusion_probe.py \
    "$D/swiglu_fusion_probe.json" > "$D/swiglu_fusion_probe.log" 2>&1
cut -c1-220 "$D/swiglu_fusion_probe.log"
bash benchmarks/results/train_step_h100_s17/chain.sh $D/ab 2750153 . \
    -- tests/kernels/test_moe_grouped.py tests/model/test_moe.py tests/kernels/test_triton_compile.py
tar czf "$OUT/s23_call1.tgz" -C /tmp s23_call1
