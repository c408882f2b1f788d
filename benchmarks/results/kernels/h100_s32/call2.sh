#!/usr/bin/env bash
# Session 32, call 2 (carry .whl): the MoE GPU tests at this tree (the plan's fused permute),
# the permute's launch-setting sweep, the head probe and the MoE bench rows.
#   usage: bash benchmarks/results/kernels/h100_s32/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/s32_call2; mkdir -p $D
save() { tar czf "$OUT/s32_call2.tgz" -C /tmp s32_call2; }
timeout 240 python3 -m pytest -q -x tests/kernels/test_moe_grouped.py tests/kernels/test_device.py > $D/gpu_tests_moe.log 2>&1
echo "tests exit $?"; tail -3 $D/gpu_tests_moe.log; save
timeout 150 python3 benchmarks/results/kernels/h100_s32/permute_sweep.py $D/permute_sweep.json > $D/permute_sweep.log 2>&1
echo "sweep exit $?"; cat $D/permute_sweep.log | tail -30; save
timeout 120 python3 benchmarks/results/kernels/h100_s32/moe_head_probe.py $D/head.json > $D/head.log 2>&1
echo "probe exit $?"; tail -24 $D/head.log; save
timeout 200 python3 benchmarks/kernels.py --name moe_h100_s32_fused --out $D --surfaces moe_experts > $D/moe_fused.log 2>&1
echo "bench exit $?"; grep -v "^{" $D/moe_fused.log | grep -v "Warn\|warn" | tail -8
save
