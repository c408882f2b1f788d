#!/usr/bin/env bash
# Session 29, eighth device call (carry .whl): the final tree's GPU tests of the document
# attention (the launch settings against Inductor's defaults bit for bit, and in the generated
# kernels) and of the graphed trainer.   usage: bash benchmarks/results/train_h100_s29/call8.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s29_call8; mkdir -p $D
save() { tar czf "$OUT/s29_call8.tgz" -C /tmp s29_call8; }
PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_document_attention.py > $D/gpu_tests_document_attention.log 2>&1
tail -3 $D/gpu_tests_document_attention.log; save
PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/train/test_cuda_graph.py tests/model/test_attention.py > $D/gpu_tests_graph_attention.log 2>&1
tail -3 $D/gpu_tests_graph_attention.log; save
