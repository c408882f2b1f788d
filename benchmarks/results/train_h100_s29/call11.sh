#!/usr/bin/env bash
# Session 29, eleventh device call (carry .whl and .device-carry/s29: c2/ = 3604323, before the
# Triton tiles): the document mask's tiles in one Triton launch. The document-attention and
# graphed-trainer GPU tests, then `megacpp train` on this tree, 3604323, this tree.
#   usage: bash benchmarks/results/train_h100_s29/call11.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s29_call11; mkdir -p $D
save() { tar czf "$OUT/s29_call11.tgz" -C /tmp s29_call11; }
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_document_attention.py > $D/gpu_tests_document_attention.log 2>&1
tail -2 $D/gpu_tests_document_attention.log; save
PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_cuda_graph.py > $D/gpu_tests_graph.log 2>&1
tail -2 $D/gpu_tests_graph.log; save
source $R/train_h100_s29/train.sh
train 10-tree $PWD/src; save
train 11-c2 $PWD/.device-carry/s29/c2/src; save
train 12-tree $PWD/src; save
