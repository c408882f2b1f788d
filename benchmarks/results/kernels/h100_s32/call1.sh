#!/usr/bin/env bash
# Session 32, first device call (carry .whl): the MoE forward's host head, idle vs busy GPU
# (moe_head_probe.py), then the MoE bench rows at this tree as the baseline.
#   usage: bash benchmarks/results/kernels/h100_s32/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/s32_call1; mkdir -p $D
save() { tar czf "$OUT/s32_call1.tgz" -C /tmp s32_call1; }
timeout 200 python3 benchmarks/results/kernels/h100_s32/moe_head_probe.py $D/head.json > $D/head.log 2>&1
echo "probe exit $?"; cat $D/head.log | tail -40; save
timeout 300 python3 benchmarks/kernels.py --name moe_h100_s32_base --out $D --surfaces moe_experts > $D/moe_base.log 2>&1
echo "bench exit $?"; grep -v "^{" $D/moe_base.log | grep -v "Warn\|warn" | tail -20
save
