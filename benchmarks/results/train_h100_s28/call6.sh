#!/usr/bin/env bash
# Session 28, sixth device call (carry .whl and .device-carry/s28): session 26's
# trainer_profile.py on this tree, and the GPU smoke tests under fast kernels.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s28_call6; mkdir -p $D
save() { tar czf "$OUT/s28_call6.tgz" -C /tmp s28_call6; }
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 200 \
    python3 $R/train_h100_s26/trainer_profile.py $D/trainer_profile.json run.out_dir=/tmp/runs/profile \
    data.dir=.device-carry/s28/data/libstdcxx-32k > $D/trainer_profile.log 2>&1
grep -v "Warning\|warn" $D/trainer_profile.log | tail -32; rm -rf /tmp/runs/profile/checkpoints
gzip -f $D/trainer_profile.trace.json
save
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 250 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -2 $D/gpu_smoke_fast.log
save
