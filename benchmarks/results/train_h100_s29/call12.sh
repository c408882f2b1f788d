#!/usr/bin/env bash
# Session 29, twelfth device call (carry .whl and .device-carry/s29): the final tree against the
# session's start, alternately (`megacpp train` 7d1ce31, tree, 7d1ce31, tree), then the
# document_attention bench row (benchmarks/kernels.py).
#   usage: bash benchmarks/results/train_h100_s29/call12.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s29_call12; mkdir -p $D
save() { tar czf "$OUT/s29_call12.tgz" -C /tmp s29_call12; }
source $R/train_h100_s29/train.sh
train 13-base $PWD/.device-carry/s29/base/src; save
train 14-tree $PWD/src; save
train 15-base $PWD/.device-carry/s29/base/src; save
train 16-tree $PWD/src; save
PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 100 python3 benchmarks/kernels.py --surfaces document_attention \
    --name document_attention_h100_s29_final --out $D/bench > $D/bench.log 2>&1
grep -E "^document_attention" $D/bench.log | cut -c1-160; save
