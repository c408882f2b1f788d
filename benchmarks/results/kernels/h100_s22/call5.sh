#!/usr/bin/env bash
# Session 22, fifth device call (carry .whl): final.sh at the tree -- hybrid and dense Llama in
# one process, then a profiled run of the hybrid with its kernel families -- on a fresh machine
# (call 4's host ran everything ~17% slower than calls 2 and 3's, Llama included).
#   usage: bash benchmarks/results/kernels/h100_s22/call5.sh
set -u
bash benchmarks/results/train_step_h100_s17/final.sh /tmp/final_s22b final_s22b
