#!/usr/bin/env bash
# Session 29, tenth device call (carry .whl and .device-carry/s29): `megacpp train` on this tree,
# 7d1ce31 (the session's start), f426222 (the flex settings alone) and this tree again, in turn.
#   usage: bash benchmarks/results/train_h100_s29/call10.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s29_call10; mkdir -p $D
save() { tar czf "$OUT/s29_call10.tgz" -C /tmp s29_call10; }
source $R/train_h100_s29/train.sh
train 6-tree $PWD/src; save
train 7-base $PWD/.device-carry/s29/base/src; save
train 8-c1 $PWD/.device-carry/s29/c1/src; save
train 9-tree $PWD/src; save
