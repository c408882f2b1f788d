#!/usr/bin/env bash
# Session 24, second device call: the gathered expert-GEMM kernels one by one against the
# written-out rows (gather_kernels_probe.py; the wgrad's pipelining depth with B gathered),
# then the whole-path probe again (gather_probe.py, with the replay's failure recorded).
#   usage: bash benchmarks/results/kernels/h100_s24/call2.sh   (at 72e1b18's tree)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
D=/tmp/s24_call2; mkdir -p $D
python3 benchmarks/results/kernels/h100_s24/gather_kernels_probe.py $D/gather_kernels_probe.json \
    > $D/gather_kernels_probe.log 2>&1
grep "^{" $D/gather_kernels_probe.log | cut -c1-200; tail -2 $D/gather_kernels_probe.log
python3 benchmarks/results/kernels/h100_s24/gather_probe.py $D/gather_probe.json > $D/gather_probe.log 2>&1
grep "^{" $D/gather_probe.log | cut -c1-300 | head -4
grep -v "^{" $D/gather_probe.log | grep -v Warn | cut -c1-300 | tail -8
tar czf "$OUT/s24_call2.tgz" -C /tmp s24_call2
