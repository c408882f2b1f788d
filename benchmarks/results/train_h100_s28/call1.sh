#!/usr/bin/env bash
# Session 28, first device call (carry .whl and .device-carry/s28): the GPU tests of what the
# session changed (the fused Muon passes, the captured optimizer step, the graphed trainer),
# benchmarks/muon_step.py, and one `megacpp train` run of this tree.
#   usage: bash benchmarks/results/train_h100_s28/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s28_call1; mkdir -p $D
save() { tar czf "$OUT/s28_call1.tgz" -C /tmp s28_call1; }
PYTHONPATH=$PWD/src:/tmp/site timeout 90 python3 -m pytest -q -rf tests/kernels/test_muon.py \
    tests/train/test_optim.py > $D/gpu_tests_muon.log 2>&1; tail -2 $D/gpu_tests_muon.log
save
PYTHONPATH=$PWD/src:/tmp/site timeout 90 python3 benchmarks/muon_step.py --out $D/muon_step \
    > $D/muon_step.log 2>&1; tail -4 $D/muon_step.log
save
PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 -m pytest -q -rf tests/train/test_cuda_graph.py \
    > $D/gpu_tests_graph.log 2>&1; tail -2 $D/gpu_tests_graph.log
save
source $R/train_h100_s28/train.sh
train 1-tree $PWD/src
save
