#!/usr/bin/env bash
# Session 30, second device call (carry .whl): ns_probe2.py (TMA symmetric products, swept).
#   usage: bash benchmarks/results/kernels/h100_s30/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s30_call2; mkdir -p $D
save() { tar czf "$OUT/s30_call2.tgz" -C /tmp s30_call2; }
PYTHONPATH=$PWD/src:/tmp/site timeout 400 python3 $R/kernels/h100_s30/ns_probe2.py $D/ns_probe2.json > $D/ns_probe2.log 2>&1
echo "exit $?"; grep -v "^W1\|warn" $D/ns_probe2.log | cut -c1-600 | tail -45; save
