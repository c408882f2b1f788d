#!/usr/bin/env bash
# Session 30, third device call (carry .whl and .device-carry/s30): GPU tests of Muon, the
# optimizer, the graphed trainer and parallelize; muon_step.py; `megacpp train` at the
# session's start (base) and at this tree.
#   usage: bash benchmarks/results/kernels/h100_s30/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s30_call3; mkdir -p $D
save() { tar czf "$OUT/s30_call3.tgz" -C /tmp s30_call3; }
PYTHONPATH=$PWD/src:/tmp/site timeout 240 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py tests/train/test_cuda_graph.py \
    tests/train/test_parallelize.py > $D/gpu_tests.log 2>&1; tail -3 $D/gpu_tests.log; save
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 benchmarks/muon_step.py --preset nam56r-350m \
    --out $D/muon_step > $D/muon_step.log 2>&1; echo "muon_step exit $?"; grep -v "^W1\|warn" $D/muon_step.log | tail -8; save
source $R/train_h100_s30/train.sh
train 1-base $PWD/.device-carry/s30/base/src; save
train 2-tree $PWD/src; save
