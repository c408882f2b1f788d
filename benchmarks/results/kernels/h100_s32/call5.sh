#!/usr/bin/env bash
# Session 32, call 5 (carry .whl and .device-carry/s32, base/ = src and benchmarks/kernels.py at
# 1055101, the session's start): the short-conv and MoE bench rows at the base tree and at this
# one, alternating twice (did the host-arithmetic change move the per-call times?), then the
# kernels GPU tests but Mamba-3's at this tree.
#   usage: bash benchmarks/results/kernels/h100_s32/call5.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s32_call5; mkdir -p $D
save() { tar czf "$OUT/s32_call5.tgz" -C /tmp s32_call5; }
NEW="$PWD/src:$PWD:/tmp/site"; BASE="$PWD/.device-carry/s32/base/src:$PWD:/tmp/site"
for round in 1 2; do
  for tree in base new; do
    if [ $tree = base ]; then P=$BASE; S=.device-carry/s32/base/benchmarks/kernels.py; else P=$NEW; S=benchmarks/kernels.py; fi
    PYTHONPATH=$P timeout 100 python3 $S --name ab_${tree}_r$round --out $D/$tree$round --surfaces short_conv,moe_experts > $D/ab_${tree}_r$round.log 2>&1
    echo "$tree r$round exit $?"; grep -v "^{" $D/ab_${tree}_r$round.log | grep "grouped_mm\|short_conv\|ceilings"
    save
  done
done
PYTHONPATH=$NEW timeout 300 python3 -m pytest -q tests/kernels --deselect tests/kernels/test_mamba3_triton.py -k "not mamba3" > $D/gpu_tests_kernels.log 2>&1
echo "tests exit $?"; tail -3 $D/gpu_tests_kernels.log; save
