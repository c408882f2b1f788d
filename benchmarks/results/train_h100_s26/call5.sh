#!/usr/bin/env bash
# Session 26, fifth device call (carry .device-carry/s26 as in call1.sh): doc_attention_probe.py
# (document-masked attention at the step's shape: masked SDPA, causal SDPA, FlexAttention).
#   usage: bash benchmarks/results/train_h100_s26/call5.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
D=/tmp/s26_call5; mkdir -p $D
timeout 400 python3 benchmarks/results/train_h100_s26/doc_attention_probe.py \
    .device-carry/s26/data/libstdcxx-32k $D/doc_attention_probe.json > $D/doc_attention_probe.log 2>&1
grep -v "Warning\|warn" $D/doc_attention_probe.log | tail -12 | cut -c1-400
tar czf "$OUT/s26_call5.tgz" -C /tmp s26_call5
