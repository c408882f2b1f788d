#!/usr/bin/env bash
# Session 32, call 3 (carry .whl and .device-carry/s32: base/ = src and benchmarks/kernels.py
# at 1055101, the session's start): the permute A/B in one process (permute_ab.py), the MoE
# bench rows at the base tree and at this one, alternating twice, and the per-call timeline
# probe of session 29 at this tree.
#   usage: bash benchmarks/results/kernels/h100_s32/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s32_call3; mkdir -p $D
save() { tar czf "$OUT/s32_call3.tgz" -C /tmp s32_call3; }
NEW="$PWD/src:$PWD:/tmp/site"; BASE="$PWD/.device-carry/s32/base/src:$PWD:/tmp/site"
PYTHONPATH=$NEW timeout 150 python3 benchmarks/results/kernels/h100_s32/permute_ab.py $D/permute_ab.json > $D/permute_ab.log 2>&1
echo "ab exit $?"; cat $D/permute_ab.log | grep PLAN; save
for round in 1 2; do
  for tree in base new; do
    if [ $tree = base ]; then P=$BASE; S=.device-carry/s32/base/benchmarks/kernels.py; else P=$NEW; S=benchmarks/kernels.py; fi
    PYTHONPATH=$P timeout 110 python3 $S --name moe_${tree}_r$round --out $D/$tree$round --surfaces moe_experts > $D/moe_${tree}_r$round.log 2>&1
    echo "$tree r$round exit $?"; grep "grouped_mm\|reference\|ceilings" $D/moe_${tree}_r$round.log
    save
  done
done
PYTHONPATH=$NEW timeout 100 python3 benchmarks/results/kernels/h100_s29/moe_percall_probe.py $D/percall > $D/percall.log 2>&1
echo "percall exit $?"; grep "==" $D/percall.log; save
