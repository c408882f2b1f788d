#!/usr/bin/env bash
# Session 30, fifth device call (carry .whl and .device-carry/s30): `megacpp train` at the
# session's start (base, bcab104) and at this tree, alternately; then the profile of this tree.
#   usage: bash benchmarks/results/kernels/h100_s30/call5.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s30_call5; mkdir -p $D
save() { tar czf "$OUT/s30_call5.tgz" -C /tmp s30_call5; }
source $R/train_h100_s30/train.sh
train 5-base $PWD/.device-carry/s30/base/src; save
train 6-tree $PWD/src; save
train 7-base $PWD/.device-carry/s30/base/src; save
train 8-tree $PWD/src; save
