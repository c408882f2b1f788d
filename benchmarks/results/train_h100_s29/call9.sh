#!/usr/bin/env bash
# Session 29, ninth device call (carry .whl and .device-carry/s29: c1/ = f426222, the flex settings
# alone): clipping folded into Muon's momentum pass. The Muon, optimizer and graphed-trainer GPU
# tests, then `megacpp train` on this tree and f426222.
#   usage: bash benchmarks/results/train_h100_s29/call9.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s29_call9; mkdir -p $D
save() { tar czf "$OUT/s29_call9.tgz" -C /tmp s29_call9; }
PYTHONPATH=$PWD/src:/tmp/site timeout 100 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py > $D/gpu_tests_muon_optim.log 2>&1
tail -2 $D/gpu_tests_muon_optim.log; save
PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_cuda_graph.py > $D/gpu_tests_graph.log 2>&1
tail -2 $D/gpu_tests_graph.log; save
source $R/train_h100_s29/train.sh
train 4-tree $PWD/src; save
train 5-c1 $PWD/.device-carry/s29/c1/src; save
