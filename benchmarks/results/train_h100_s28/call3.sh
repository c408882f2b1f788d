#!/usr/bin/env bash
# Session 28, third device call (carry .whl and .device-carry/s28): bisect call 1's "invalid
# argument": muon_probe.py without CUDA_LAUNCH_BLOCKING; the graphed-trainer GPU tests on
# ae936b6 (the trainer change alone, .device-carry/s28/c1) and on this tree with
# CUDA_LAUNCH_BLOCKING=1 (first failure).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s28_call3; mkdir -p $D
save() { tar czf "$OUT/s28_call3.tgz" -C /tmp s28_call3; }
PYTHONPATH=$PWD/src:/tmp/site timeout 100 python3 benchmarks/results/train_h100_s28/muon_probe.py \
    tiny > $D/probe_tiny.log 2>&1; echo "probe exit $?"; grep -v "^  step" $D/probe_tiny.log | tail -20
save
PYTHONPATH=$PWD/.device-carry/s28/c1/src:/tmp/site timeout 150 python3 -m pytest -q -x -rf \
    -p no:cacheprovider tests/train/test_cuda_graph.py > $D/graph_tests_c1.log 2>&1; tail -3 $D/graph_tests_c1.log
save
CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -x -rf \
    -p no:cacheprovider tests/train/test_cuda_graph.py > $D/graph_tests_tree_blocking.log 2>&1
tail -3 $D/graph_tests_tree_blocking.log; grep -n "triton.py\|optim.py\|Error" $D/graph_tests_tree_blocking.log | head -20
save
