#!/usr/bin/env bash
# Session 27, seventh device call (no carry): the document-attention GPU tests after their
# shared inputs and fwd+bwd moved into helpers (a refactor of the tests only).
#   usage: bash benchmarks/results/train_h100_s27/call7.sh
set -u
D=/tmp/s27_call7; mkdir -p $D
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    tests/model/test_attention.py > $D/gpu_tests.log 2>&1; tail -2 $D/gpu_tests.log
tar czf "$OUT/s27_call7.tgz" -C /tmp s27_call7
