#!/usr/bin/env bash
# Session 26, eighth device call (no carry): flex_traced_probe.py, FlexAttention over
# document_block_mask traced by torch.compile against the float64 reference.
#   usage: bash benchmarks/results/train_h100_s26/call8.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
D=/tmp/s26_call8; mkdir -p $D
timeout 400 python3 benchmarks/results/train_h100_s26/flex_traced_probe.py $D/flex_traced_probe.json \
    > $D/flex_traced_probe.log 2>&1
grep -v "Warning\|warn" $D/flex_traced_probe.log | tail -12 | cut -c1-300
tar czf "$OUT/s26_call8.tgz" -C /tmp s26_call8
