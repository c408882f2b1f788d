#!/usr/bin/env bash
# Session 27, first device call (carry .whl and .device-carry/s27: the dataset as in session 26,
# base/ = 3929c77's src and configs, the masked SDPA): mask_probe.py (Inductor's sort, traced vs
# eager), session 26's flex_traced_probe.py on this tree, the document-attention and attention
# GPU tests, then `megacpp train` with flex chosen (this tree) and 3929c77, alternately, then the
# CUDA-graph and GPU smoke tests under fast kernels.
#   usage: bash benchmarks/results/train_h100_s27/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s27_call1; mkdir -p $D
save() { tar czf "$OUT/s27_call1.tgz" -C /tmp s27_call1; }
PYTHONPATH=$PWD/src timeout 120 python3 $R/train_h100_s27/mask_probe.py $D/mask_probe.json \
    > $D/mask_probe.log 2>&1; grep "^[a-z]*/" $D/mask_probe.log | cut -c1-240
PYTHONPATH=$PWD/src timeout 150 python3 $R/train_h100_s26/flex_traced_probe.py $D/flex_traced_probe.json \
    > $D/flex_traced_probe.log 2>&1; grep "^[a-z_]*/" $D/flex_traced_probe.log | cut -c1-200
save
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    tests/model/test_attention.py > $D/gpu_tests.log 2>&1; tail -2 $D/gpu_tests.log
save
CFG=$R/train_h100_s27/train_350m.toml
train() {  # $1 = run name, $2 = src
    MEGACPP_KERNELS=fast PYTHONPATH=$2 timeout 150 python3 -m megacpp train --config $CFG --no-progress \
        --set parallel.compile=true --set parallel.cuda_graph=true --set run.out_dir=/tmp/runs/$1 \
        > $D/train_$1.log 2>&1
    cp /tmp/runs/$1/metrics.jsonl $D/metrics_$1.jsonl; cp /tmp/runs/$1/receipt.json $D/receipt_$1.json
    rm -rf /tmp/runs/$1/checkpoints
    echo "$1 $(python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('$D/metrics_$1.jsonl') if '\"train\"' in l]
t = [r['time_s'] for r in rows if r['step'] >= 9]
print(f'steps 9-30 median {1e3 * statistics.median(t):.1f} ms, {16384 / statistics.median(t):,.0f} tokens/s, loss step 4 {rows[3][\"loss\"]:.4f} step 30 {rows[-1][\"loss\"]:.4f}, grad norm step 1 {rows[0][\"grad_norm\"]:.1f}')
" 2>&1 | tail -1)"
    save
}
train 1-tree $PWD/src
train 2-base $PWD/.device-carry/s27/base/src
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 -m pytest -q -rf \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -2 $D/gpu_smoke_fast.log
PYTHONPATH=$PWD/src:/tmp/site timeout 100 python3 -m pytest -q -rf tests/train/test_cuda_graph.py \
    > $D/gpu_cuda_graph.log 2>&1; tail -2 $D/gpu_cuda_graph.log; save
[ $SECONDS -lt 390 ] && train 3-tree $PWD/src
[ $SECONDS -lt 470 ] && train 4-base $PWD/.device-carry/s27/base/src
save
