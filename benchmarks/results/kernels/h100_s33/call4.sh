#!/usr/bin/env bash
# Session 33, call 4: _bwd_dqk's TMA loads (TUNING["dqk_tma"]) against pointer loads, then the
# Mamba-3 GPU tests with TMA on (the default in this tree).
#   usage: bash benchmarks/results/kernels/h100_s33/call4.sh   (carrying .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
D=$OUT/call4; mkdir -p $D
timeout 330 python3 benchmarks/results/kernels/h100_s33/dqk_tma_probe.py $D/dqk_tma_probe.json > $D/dqk_tma_probe.log 2>&1
echo "probe exit $?"; cut -c1-400 $D/dqk_tma_probe.log | grep -v "^{" | tail -5
python3 - $D/dqk_tma_probe.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["case"], r["setting"], r["round"], r["replay_ms"], r["per_call_ms"],
          r.get("kernels_us", {}).get("_bwd_dqk", ""), r.get("max_rel_diff_vs_pointer", ""))
PY
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mamba3_triton.py tests/model/test_mamba3.py > $D/gpu_tests_mamba3.log 2>&1
echo "tests exit $?"; tail -3 $D/gpu_tests_mamba3.log
