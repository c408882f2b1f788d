#!/usr/bin/env bash
# Session 22, sixth device call (carry .whl): moe_load_probe.py, then the training step of the
# tree with the MoE load as the tree has it (one-hot column sum), over 64 row chunks, and as an
# index_add of ones (moe_load_step.py); with a profile of the tree's form.
#   usage: bash benchmarks/results/kernels/h100_s22/call6.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/moe_load; mkdir -p $D
python3 benchmarks/results/kernels/h100_s22/moe_load_probe.py "$D/moe_load_probe.json" > "$D/moe_load_probe.log" 2>&1
tail -5 "$D/moe_load_probe.log"
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast --models hybrid --modes compiled-graphed"
for V in onehot chunked index_add; do
    python3 benchmarks/results/kernels/h100_s22/moe_load_step.py $V $ARGS --out "$D/$V.json" > "$D/$V.log" 2>&1
    echo "$V $(grep "L=2048" "$D/$V.log")"
done
tar czf "$OUT/moe_load.tgz" -C /tmp moe_load
