#!/usr/bin/env bash
# Session 28, eighth device call (carry .whl): after the review mend (one address table per
# fused Muon launch; muon_step.py's families from megacpp.kernels.profiling.kernel_family):
# the Muon and optimizer GPU tests, then benchmarks/muon_step.py again.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s28_call8; mkdir -p $D
PYTHONPATH=$PWD/src:/tmp/site timeout 90 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py > $D/gpu_tests_muon.log 2>&1; tail -2 $D/gpu_tests_muon.log
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 benchmarks/muon_step.py --out $D/muon_step \
    > $D/muon_step.log 2>&1; grep -v -i warn $D/muon_step.log | tail -4
tar czf "$OUT/s28_call8.tgz" -C /tmp s28_call8
