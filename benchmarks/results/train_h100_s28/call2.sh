#!/usr/bin/env bash
# Session 28, second device call: muon_probe.py with CUDA_LAUNCH_BLOCKING=1 (the tiny preset,
# then nam56r-350m), to find call 1's "invalid argument".
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s28_call2; mkdir -p $D
for preset in tiny nam56r-350m; do
  CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 \
    benchmarks/results/train_h100_s28/muon_probe.py $preset > $D/probe_$preset.log 2>&1
  echo "$preset exit $?"; grep -v "^  step" $D/probe_$preset.log | tail -25
done
tar czf "$OUT/s28_call2.tgz" -C /tmp s28_call2
