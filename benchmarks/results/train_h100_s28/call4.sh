#!/usr/bin/env bash
# Session 28, fourth device call (carry .whl and .device-carry/s28): after the capture fix
# (pinned tables not freed inside a capture): the GPU tests of the Muon passes and the
# optimizer, the same optimizer test on b0fe861 (call 1's tree, .device-carry/s28/c2: it must
# fail), the graphed-trainer tests, benchmarks/muon_step.py, then `megacpp train` on this tree
# and on 5ac46ad (.device-carry/s28/base, session 27's end).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s28_call4; mkdir -p $D
save() { tar czf "$OUT/s28_call4.tgz" -C /tmp s28_call4; }
PYTHONPATH=$PWD/src:/tmp/site timeout 90 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py > $D/gpu_tests_muon.log 2>&1; tail -2 $D/gpu_tests_muon.log
PYTHONPATH=$PWD/.device-carry/s28/c2/src:/tmp/site timeout 60 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_optim.py > $D/gpu_tests_optim_b0fe861.log 2>&1; tail -3 $D/gpu_tests_optim_b0fe861.log
save
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_cuda_graph.py > $D/gpu_tests_graph.log 2>&1; tail -2 $D/gpu_tests_graph.log
save
PYTHONPATH=$PWD/src:/tmp/site timeout 90 python3 benchmarks/muon_step.py --out $D/muon_step \
    > $D/muon_step.log 2>&1; tail -4 $D/muon_step.log
save
source $R/train_h100_s28/train.sh
train 1-tree $PWD/src; save
train 2-base $PWD/.device-carry/s28/base/src; save
