#!/usr/bin/env bash
# Session 21, third device call (carry .whl and .device-carry): the RMSNorm / ops GPU tests and
# the GPU smoke tests, then the training step of 77cb315 (session 20's kernels) and of the tree
# (attention's kv_proj on the norm's second copy, the MoE load without atomics), alternately,
# twice each.   usage: bash benchmarks/results/kernels/h100_s21/call3.sh
set -u
bash benchmarks/results/train_step_h100_s17/chain.sh /tmp/ab_fanout 77cb315 . 77cb315 . \
    -- tests/kernels/test_ops_triton.py tests/train/test_gpu_smoke.py tests/model/test_attention.py \
    tests/model/test_moe.py
