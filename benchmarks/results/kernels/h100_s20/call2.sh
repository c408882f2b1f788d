#!/usr/bin/env bash
# Session 20, second device call (working tree = 5885b98; carry .whl): final.sh (hybrid and
# dense Llama, compiled and compiled + CUDA graph, then the profiled hybrid) and step_ops.py at
# the tree.   usage: bash benchmarks/results/kernels/h100_s20/call2.sh
set -u
bash benchmarks/results/train_step_h100_s17/final.sh /tmp/final_s20 final_s20
bash benchmarks/results/train_step_h100_s17/ops_chain.sh /tmp/ops_s20 .
