#!/usr/bin/env bash
# Session 25, second device call (run twice: the first run's probe kept its y's graph alive and its
# capture failed; fixed in the probe), at the tree with TUNING["tt_in_dx"] (5f50e80): the Mamba-3
# settings probe (mamba3_tt_probe.py), then the Mamba-3 GPU tests (against the float64
# reference, bf16 and float32).   usage: bash benchmarks/results/kernels/h100_s25/call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
D=/tmp/s25_call2; mkdir -p $D
python3 benchmarks/results/kernels/h100_s25/mamba3_tt_probe.py $D/mamba3_tt_probe.json > $D/mamba3_tt_probe.log 2>&1
grep "^{" $D/mamba3_tt_probe.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    k = r.get('kernels_us', {})
    print(r['case'], r['setting'], r.get('replay_ms'), r.get('kernels_us_total'), k.get('_bwd_dx'), k.get('_bwd_dqk'), '%.1e' % r.get('max_rel_err_vs_shipped', -1), r.get('error', ''))
"
tail -2 $D/mamba3_tt_probe.log | cut -c1-300
python3 -m pytest -q -rf tests/kernels/test_mamba3_triton.py > $D/gpu_tests.log 2>&1; tail -3 $D/gpu_tests.log
tar czf "$OUT/s25_call2.tgz" -C /tmp s25_call2
