#!/usr/bin/env bash
# Session 26, tenth device call (no carry): call 9's block mask returned its kv counts as a
# transposed view; made contiguous here. flex_traced_probe.py and the document attention GPU
# tests only (the session's device time was nearly spent).
#   usage: bash benchmarks/results/train_h100_s26/call10.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
D=/tmp/s26_call10; mkdir -p $D
timeout 200 python3 benchmarks/results/train_h100_s26/flex_traced_probe.py $D/flex_traced_probe.json \
    > $D/flex_traced_probe.log 2>&1; grep "^[a-z_]*/" $D/flex_traced_probe.log | cut -c1-200
tar czf "$OUT/s26_call10.tgz" -C /tmp s26_call10
timeout 150 python3 -m pytest -q -rf tests/kernels/test_document_attention.py > $D/gpu_tests.log 2>&1
tail -2 $D/gpu_tests.log
tar czf "$OUT/s26_call10.tgz" -C /tmp s26_call10
