#!/usr/bin/env bash
# Session 20, sixth device call (carry .whl and .device-carry): the MoE GPU tests and the sm_90
# compile tests, then the training step of 36506fe (before the expert-GEMM kernel) and of the
# tree, alternately, twice each.   usage: bash benchmarks/results/kernels/h100_s20/call6.sh
set -u
bash benchmarks/results/train_step_h100_s17/chain.sh /tmp/ab_grouped_mm 36506fe . 36506fe . \
    -- tests/kernels/test_moe_grouped.py tests/kernels/test_triton_compile.py
