#!/usr/bin/env bash
# Session 34, call 1: TUNING["joined"] (one matmul over interleaved pairs) against the halves,
# then the Mamba-3 GPU tests with joined on.
#   usage: bash benchmarks/results/kernels/h100_s34/call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
D=$OUT/call1; mkdir -p $D
timeout 400 python3 benchmarks/results/kernels/h100_s34/joined_probe.py $D/joined_probe.json > $D/joined_probe.log 2>&1
echo "probe exit $?"; grep -v '^{' $D/joined_probe.log | cut -c1-300 | tail -5
python3 - $D/joined_probe.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["case"], r["setting"], r["round"], r["replay_ms"], r["per_call_ms"],
          r.get("max_rel_diff_vs_halves", ""), r.get("kernels_us", ""))
PY
grep '"kernel"' $D/joined_probe.log
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mamba3_triton.py tests/model/test_mamba3.py > $D/gpu_tests_mamba3.log 2>&1
echo "tests exit $?"; tail -3 $D/gpu_tests_mamba3.log
