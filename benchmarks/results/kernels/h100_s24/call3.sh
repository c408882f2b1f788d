#!/usr/bin/env bash
# Session 24, third device call: the Mamba-3 _bwd_dqk launch settings and chunk cap sweep
# (mamba3_dqk_sweep.py) at the tree.   usage: bash benchmarks/results/kernels/h100_s24/call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
D=/tmp/s24_call3; mkdir -p $D
python3 benchmarks/results/kernels/h100_s24/mamba3_dqk_sweep.py $D/mamba3_dqk_sweep.json > $D/mamba3_dqk_sweep.log 2>&1
grep "^{" $D/mamba3_dqk_sweep.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r['case'], r['setting'], r.get('ms'), r.get('kernels_us', {}).get('_bwd_dqk'), r.get('max_rel_err_vs_shipped'), r.get('error', ''))
"
tail -3 $D/mamba3_dqk_sweep.log | cut -c1-300
tar czf "$OUT/s24_call3.tgz" -C /tmp s24_call3
