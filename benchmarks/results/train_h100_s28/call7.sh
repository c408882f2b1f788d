#!/usr/bin/env bash
# Session 28, seventh device call (carry .whl and .device-carry/s28): the final tree (the
# previous step's record emitted after this step's update is launched): the graphed-trainer
# GPU tests, then `megacpp train` on this tree, 5ac46ad and this tree again.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s28_call7; mkdir -p $D
save() { tar czf "$OUT/s28_call7.tgz" -C /tmp s28_call7; }
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_cuda_graph.py tests/train/test_optim.py > $D/gpu_tests_graph.log 2>&1; tail -2 $D/gpu_tests_graph.log
save
source $R/train_h100_s28/train.sh
train 6-tree $PWD/src; save
train 7-base $PWD/.device-carry/s28/base/src; save
train 8-tree $PWD/src; save
