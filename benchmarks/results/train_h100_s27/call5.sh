#!/usr/bin/env bash
# Session 27, fifth device call (carry .whl and .device-carry/s27 as in call1.sh): the final
# tree (document_attention_flex calls flex_attention itself when a compile is tracing it, no
# nested torch.compile): the document-attention GPU tests, the GPU smoke tests under fast
# kernels, `megacpp train` on this tree and 3929c77 once more.
#   usage: bash benchmarks/results/train_h100_s27/call5.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s27_call5; mkdir -p $D
save() { tar czf "$OUT/s27_call5.tgz" -C /tmp s27_call5; }
PYTHONPATH=$PWD/src:/tmp/site timeout 100 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    > $D/gpu_tests.log 2>&1; tail -2 $D/gpu_tests.log
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 -m pytest -q -rf \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -2 $D/gpu_smoke_fast.log
save
CFG=$R/train_h100_s27/train_350m.toml
train() {  # $1 = run name, $2 = src
    MEGACPP_KERNELS=fast PYTHONPATH=$2 timeout 150 python3 -m megacpp train --config $CFG --no-progress \
        --set parallel.compile=true --set parallel.cuda_graph=true --set run.out_dir=/tmp/runs/$1 \
        > $D/train_$1.log 2>&1
    echo "exit $?"
    cp /tmp/runs/$1/metrics.jsonl $D/metrics_$1.jsonl; cp /tmp/runs/$1/receipt.json $D/receipt_$1.json
    rm -rf /tmp/runs/$1/checkpoints
    echo "$1 $(python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('$D/metrics_$1.jsonl')]
val = [r['val_loss'] for r in rows if r['type'] == 'val']
rows = [r for r in rows if r['type'] == 'train']
t = [r['time_s'] for r in rows if r['step'] >= 9]
print(f'steps 9-30 median {1e3 * statistics.median(t):.1f} ms, {16384 / statistics.median(t):,.0f} tokens/s, loss step 4 {rows[3][\"loss\"]:.4f} step 30 {rows[-1][\"loss\"]:.4f}, grad norm step 1 {rows[0][\"grad_norm\"]:.1f}, val {val}')
" 2>&1 | tail -1)"
    save
}
train 5-tree $PWD/src
train 6-base $PWD/.device-carry/s27/base/src
save
