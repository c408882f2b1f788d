#!/usr/bin/env bash
# Session 24, fourth device call: launch settings of the gate|up + SwiGLU kernel, graph-timed
# (swiglu_tile_sweep.py), at the tree.   usage: bash benchmarks/results/kernels/h100_s24/call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
D=/tmp/s24_call4; mkdir -p $D
python3 benchmarks/results/kernels/h100_s24/swiglu_tile_sweep.py $D/swiglu_tile_sweep.json > $D/swiglu_tile_sweep.log 2>&1
grep "^{" $D/swiglu_tile_sweep.log | cut -c1-200; tail -2 $D/swiglu_tile_sweep.log | cut -c1-300
tar czf "$OUT/s24_call4.tgz" -C /tmp s24_call4
