#!/usr/bin/env bash
# Session 24, first device call: the gather probe (gather_probe.py: the MoE permute read in the
# expert GEMMs' operand loads against the rows written out first, one process), then the MoE
# GPU tests, the MoE model tests and the offline compile tests at the tree.
#   usage: bash benchmarks/results/kernels/h100_s24/call1.sh   (at 72e1b18's tree; carry .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
D=/tmp/s24_call1; mkdir -p $D
python3 benchmarks/results/kernels/h100_s24/gather_probe.py $D/gather_probe.json > $D/gather_probe.log 2>&1
grep -v "^{" $D/gather_probe.log | cut -c1-400
python3 - $D/gather_probe.json <<'PY'
import json, statistics, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "replay_ms" in r]
for case in dict.fromkeys(r["case"] for r in rows):
    for mode in ("written", "gathered"):
        rs = [r for r in rows if r["case"] == case and r["mode"] == mode]
        print(case, mode, "per call", [round(r["per_call_ms"], 3) for r in rs],
              "replay", [round(r["replay_ms"], 3) for r in rs], "peak GiB",
              round(rs[0]["peak_gib"], 3), "same bits", rs[0]["bitwise_same"])
PY
python3 -m pytest -q -rf tests/kernels/test_moe_grouped.py tests/model/test_moe.py \
    tests/kernels/test_triton_compile.py > $D/gpu_tests.log 2>&1
tail -3 $D/gpu_tests.log
tar czf "$OUT/s24_call1.tgz" -C /tmp s24_call1
