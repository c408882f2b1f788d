#!/usr/bin/env bash
# Session 29, first device call (carry .whl): where the MoE bench rows' per-call time goes
# beyond their graph replays (moe_percall_probe.py, both bench cases).
#   usage: bash benchmarks/results/kernels/h100_s29/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s29_call1; mkdir -p $D
PYTHONPATH=$PWD/src:/tmp/site timeout 300 python3 benchmarks/results/kernels/h100_s29/moe_percall_probe.py \
    $D/probe > $D/probe.log 2>&1; cat $D/probe.log | grep -v -i warn | cut -c1-140
gzip -f $D/probe/*.trace.json
tar czf "$OUT/s29_call1.tgz" -C /tmp s29_call1
