#!/usr/bin/env bash
# Session 30, sixth device call (carry .whl): flex_flags.py (FlexAttention mask-shape flags).
#   usage: bash benchmarks/results/kernels/h100_s30/call6.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s30_call6; mkdir -p $D
save() { tar czf "$OUT/s30_call6.tgz" -C /tmp s30_call6; }
PYTHONPATH=$PWD/src:/tmp/site timeout 300 python3 $R/kernels/h100_s30/flex_flags.py $D/flex_flags.json > $D/flex_flags.log 2>&1
echo "exit $?"; grep "^docs\|Error\|error" $D/flex_flags.log | tail -20; save
