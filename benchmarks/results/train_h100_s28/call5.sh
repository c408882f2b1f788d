#!/usr/bin/env bash
# Session 28, fifth device call (carry .whl and .device-carry/s28): the optimizer GPU test on
# b0fe861 (call 1's tree, with its configs this time: the captured fused step must fail, the
# reference one pass), then `megacpp train` on ae936b6 (the trainer change alone,
# .device-carry/s28/c1), this tree and 5ac46ad (.device-carry/s28/base), in turn.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s28_call5; mkdir -p $D
save() { tar czf "$OUT/s28_call5.tgz" -C /tmp s28_call5; }
PYTHONPATH=$PWD/.device-carry/s28/c2/src:/tmp/site timeout 60 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_optim.py > $D/gpu_tests_optim_b0fe861.log 2>&1; tail -3 $D/gpu_tests_optim_b0fe861.log
save
source $R/train_h100_s28/train.sh
train 3-c1 $PWD/.device-carry/s28/c1/src; save
train 4-tree $PWD/src; save
train 5-base $PWD/.device-carry/s28/base/src; save
