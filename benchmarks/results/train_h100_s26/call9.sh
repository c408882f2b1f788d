#!/usr/bin/env bash
# Session 26, ninth device call (carry .whl and .device-carry/s26 as in call6.sh): the block
# mask's kv order now a scatter (no sort) and flex chosen again, traced into compiled blocks:
# flex_traced_probe.py, the GPU tests (as call 7), then `megacpp train` on this tree and on
# 2123b32 (masked SDPA), alternately while time lasts.
#   usage: bash benchmarks/results/train_h100_s26/call9.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s26_call9; mkdir -p $D
PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/results/train_h100_s26/flex_traced_probe.py \
    $D/flex_traced_probe.json > $D/flex_traced_probe.log 2>&1; grep "^[a-z_]*/" $D/flex_traced_probe.log | cut -c1-200
PYTHONPATH=$PWD/src:/tmp/site timeout 240 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    tests/model/test_attention.py tests/train/test_cuda_graph.py > $D/gpu_tests.log 2>&1
tail -2 $D/gpu_tests.log
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -rf \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -2 $D/gpu_smoke_fast.log
tar czf "$OUT/s26_call9.tgz" -C /tmp s26_call9
CFG=benchmarks/results/train_h100_s26/train_350m.toml
i=0
for T in tree muon; do
    i=$((i + 1)); name="$i-$T"
    src=$PWD/src; [ "$T" != tree ] && src=$PWD/.device-carry/s26/$T/src
    MEGACPP_KERNELS=fast PYTHONPATH=$src timeout 150 python3 -m megacpp train --config $CFG --no-progress \
        --set parallel.compile=true --set parallel.cuda_graph=true --set run.out_dir=/tmp/runs/$name \
        > $D/train_$name.log 2>&1
    cp /tmp/runs/$name/metrics.jsonl $D/metrics_$name.jsonl; cp /tmp/runs/$name/receipt.json $D/receipt_$name.json
    rm -rf /tmp/runs/$name/checkpoints
    echo "$name $(python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open('$D/metrics_$name.jsonl') if '\"train\"' in l]
t = [r['time_s'] for r in rows if r['step'] >= 9]
print(f'steps 9-30 median {1e3 * statistics.median(t):.1f} ms, {16384 / statistics.median(t):,.0f} tokens/s, loss {rows[-1][\"loss\"]:.4f}, grad norm step 1 {rows[0][\"grad_norm\"]:.1f}')
" 2>&1 | tail -1)"
    tar czf "$OUT/s26_call9.tgz" -C /tmp s26_call9
    [ $SECONDS -gt 420 ] && break
done
tar czf "$OUT/s26_call9.tgz" -C /tmp s26_call9
