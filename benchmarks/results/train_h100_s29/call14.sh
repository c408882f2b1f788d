#!/usr/bin/env bash
# Session 29, fourteenth device call (carry .whl): after the review mend (622ebf4: Muon.takes_grad_scale,
# the AdamW groups clipped directly): the Muon, optimizer and graphed-trainer GPU tests.
#   usage: bash benchmarks/results/train_h100_s29/call14.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s29_call14; mkdir -p $D
PYTHONPATH=$PWD/src:/tmp/site timeout 250 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py tests/train/test_cuda_graph.py \
    > $D/gpu_tests.log 2>&1
tail -2 $D/gpu_tests.log
tar czf "$OUT/s29_call14.tgz" -C /tmp s29_call14
