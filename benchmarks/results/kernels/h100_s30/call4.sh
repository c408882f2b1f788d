#!/usr/bin/env bash
# Session 30, fourth device call (carry .whl and .device-carry/s30): Muon GPU tests and
# muon_step.py at this tree (the polynomial kernel with the normalization folded in); then
# `megacpp train` at c1 (the polynomial kernel alone, 9e20ac8) and at this tree.
#   usage: bash benchmarks/results/kernels/h100_s30/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s30_call4; mkdir -p $D
save() { tar czf "$OUT/s30_call4.tgz" -C /tmp s30_call4; }
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py > $D/gpu_tests.log 2>&1; tail -3 $D/gpu_tests.log; save
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 benchmarks/muon_step.py --preset nam56r-350m \
    --out $D/muon_step > $D/muon_step.log 2>&1; echo "muon_step exit $?"; grep -v "^W1\|warn" $D/muon_step.log | tail -5; save
source $R/train_h100_s30/train.sh
train 3-c1 $PWD/.device-carry/s30/c1/src; save
train 4-tree $PWD/src; save
