#!/usr/bin/env bash
# Session 29, second device call (carry .whl): the host cost of each step of the MoE's grouped
# forward and backward (moe_host_probe.py, both bench cases, with a cProfile of fwd+bwd).
#   usage: bash benchmarks/results/kernels/h100_s29/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s29_call2; mkdir -p $D
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
for c in e64_k8 e16_k2; do
    PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 benchmarks/results/kernels/h100_s29/moe_host_probe.py \
        $D/host_$c.json --case $c > $D/host_$c.log 2>&1; grep -v -i warn $D/host_$c.log | head -60 | cut -c1-150
done
tar czf "$OUT/s29_call2.tgz" -C /tmp s29_call2
