#!/usr/bin/env bash
# Session 26, fourth device call (carry .whl and .device-carry/s26 as in call1.sh): the
# trainer's and the optimizer's GPU tests (call 3 ran them without the wheels: their dataset
# fixture needs tree_sitter), then trainer_profile.py on this tree.
#   usage: bash benchmarks/results/train_h100_s26/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site
D=/tmp/s26_call4; mkdir -p $D
timeout 300 python3 -m pytest -q -rf -m gpu tests/train/test_optim.py tests/train/test_cuda_graph.py \
    tests/train/test_gpu_smoke.py tests/kernels/test_profiling.py > $D/gpu_tests.log 2>&1
tail -3 $D/gpu_tests.log
timeout 240 python3 benchmarks/results/train_h100_s26/trainer_profile.py $D/trainer_profile.json \
    run.out_dir=/tmp/runs/profile > $D/trainer_profile.log 2>&1
grep -v "Warning\|warn" $D/trainer_profile.log | tail -45
rm -rf /tmp/runs/profile/checkpoints
tar czf "$OUT/s26_call4.tgz" -C /tmp s26_call4
