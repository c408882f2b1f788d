#!/usr/bin/env bash
# Session 21, second device call: dqk_loop_probe.py (the persistent _bwd_dqk settings).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
D=$OUT/s21_call2; mkdir -p "$D"
python3 benchmarks/results/kernels/h100_s21/dqk_loop_probe.py "$D/dqk_loop_probe.jsonl" 2>&1 \
    | grep -v Warn | tee "$D/dqk_loop_probe.log"
