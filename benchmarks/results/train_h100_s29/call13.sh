#!/usr/bin/env bash
# Session 29, thirteenth device call (carry .whl and .device-carry/s29: c3/ = cbce64f, before
# muon_normalize): Newton-Schulz's normalization as one fused two-pass launch. The Muon and
# optimizer GPU tests, benchmarks/muon_step.py on cbce64f and this tree, then `megacpp train` on
# this tree and cbce64f.   usage: bash benchmarks/results/train_h100_s29/call13.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s29_call13; mkdir -p $D
save() { tar czf "$OUT/s29_call13.tgz" -C /tmp s29_call13; }
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_muon.py tests/train/test_optim.py > $D/gpu_tests_muon_optim.log 2>&1
tail -2 $D/gpu_tests_muon_optim.log; save
for T in c3 tree; do
    src=$PWD/src; [ $T != tree ] && src=$PWD/.device-carry/s29/$T/src
    PYTHONPATH=$src:$PWD:/tmp/site timeout 120 python3 benchmarks/muon_step.py --out $D/muon_step_$T \
        > $D/muon_step_$T.log 2>&1; echo "== muon_step $T"; grep -v -i warn $D/muon_step_$T.log | tail -3
done; save
source $R/train_h100_s29/train.sh
train 17-tree $PWD/src; save
train 18-c3 $PWD/.device-carry/s29/c3/src; save
