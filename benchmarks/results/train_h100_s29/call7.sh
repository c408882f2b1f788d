#!/usr/bin/env bash
# Session 29, seventh device call (carry .whl and .device-carry/s29: base/ = 7d1ce31, the session's
# start, and data/): FlexAttention's H100 launch settings for the document attention
# (flex_kernel_options). The document-attention GPU tests, `megacpp train` on this tree, 7d1ce31
# and this tree again, then the document_attention bench row (benchmarks/kernels.py).
#   usage: bash benchmarks/results/train_h100_s29/call7.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s29_call7; mkdir -p $D
save() { tar czf "$OUT/s29_call7.tgz" -C /tmp s29_call7; }
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_document_attention.py > $D/gpu_tests_document_attention.log 2>&1
tail -2 $D/gpu_tests_document_attention.log; save
source $R/train_h100_s29/train.sh
train 1-tree $PWD/src; save
train 2-base $PWD/.device-carry/s29/base/src; save
train 3-tree $PWD/src; save
PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 100 python3 benchmarks/kernels.py --surfaces document_attention \
    --name document_attention_h100_s29 --out $D/bench > $D/bench.log 2>&1
grep -E "^document_attention" $D/bench.log | cut -c1-160; save
