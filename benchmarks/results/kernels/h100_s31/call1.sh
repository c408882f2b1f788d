#!/usr/bin/env bash
# Session 31, first device call (carry .whl and .device-carry/s30): the Muon and catalog GPU
# tests; muon_polynomial's rows of benchmarks/kernels.py and `megacpp kernels check`; session
# 30's FlexAttention flag probe with its errors against the float32 reference (one round);
# session 26's trainer profile at this tree.
#   usage: bash benchmarks/results/kernels/h100_s31/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:/tmp/site
R=benchmarks/results; D=/tmp/s31_call1; mkdir -p $D
save() { tar czf "$OUT/s31_call1.tgz" -C /tmp s31_call1; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_muon.py tests/kernels/test_catalog.py \
    tests/kernels/test_bench_script.py > $D/gpu_tests.log 2>&1
echo "tests exit $?"; tail -3 $D/gpu_tests.log; save
timeout 150 python3 benchmarks/kernels.py --surfaces muon_polynomial --name muon_polynomial_h100_s31 \
    --out $D/bench > $D/bench.log 2>&1
echo "bench exit $?"; grep -v "^{" $D/bench.log | tail -12; save
timeout 120 python3 -m megacpp kernels check --surface muon_polynomial --dtype bfloat16 --dtype float16 \
    > $D/kernels_check.log 2>&1
echo "check exit $?"; tail -14 $D/kernels_check.log; save
timeout 200 python3 $R/kernels/h100_s30/flex_flags.py $D/flex_flags.json 1 > $D/flex_flags.log 2>&1
echo "flex exit $?"; grep "^docs\|rror" $D/flex_flags.log | cut -c1-300 | tail -24; save
MEGACPP_KERNELS=fast timeout 200 \
    python3 $R/train_h100_s26/trainer_profile.py $D/trainer_profile.json run.out_dir=/tmp/runs/profile \
    data.dir=.device-carry/s30/data/libstdcxx-32k > $D/trainer_profile.log 2>&1
echo "profile exit $?"; grep -v "Warning\|warn" $D/trainer_profile.log | sed -n '/family/,/total GPU/p'; grep "wall\|recompile" $D/trainer_profile.log | head
rm -rf /tmp/runs/profile/checkpoints; gzip -f $D/trainer_profile.trace.json
save
