#!/usr/bin/env bash
# Session 27, third device call (carry .whl and .device-carry/s27 as in call1.sh): the block
# mask's eight tensors now come from one custom operator (document_block_tiles). Call 2's
# trainer with flex chosen hit an illegal address in its first no-grad forward (the final
# validation): flex_layout_probe.py with --no-grad for call 2's construction and this tree's,
# each in its own process, and this tree's with gradients; the document-attention GPU tests;
# `megacpp train` (this tree, flex chosen, and 3929c77); the GPU smoke tests under fast kernels.
#   usage: bash benchmarks/results/train_h100_s27/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s27_call3; mkdir -p $D
save() { tar czf "$OUT/s27_call3.tgz" -C /tmp s27_call3; }
for args in "--no-grad --only four_d" "--no-grad --only operator" "--only operator"; do
    tag=$(echo $args | tr -d ' -'); echo "probe $args"
    PYTHONPATH=$PWD/src timeout 100 python3 $R/train_h100_s27/flex_layout_probe.py $args \
        $D/probe_$tag.json > $D/probe_$tag.log 2>&1
    grep "^[a-z_0-9]* {" $D/probe_$tag.log | cut -c1-300; grep -m2 "Error" $D/probe_$tag.log | cut -c1-200
done
save
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    > $D/gpu_tests.log 2>&1; tail -2 $D/gpu_tests.log
save
CFG=$R/train_h100_s27/train_350m.toml
train() {  # $1 = run name, $2 = src
    MEGACPP_KERNELS=fast PYTHONPATH=$2 timeout 150 python3 -m megacpp train --config $CFG --no-progress \
        --set parallel.compile=true --set parallel.cuda_graph=true --set run.out_dir=/tmp/runs/$1 \
        > $D/train_$1.log 2>&1
    echo "exit $?"; grep -m1 "illegal\|Error:" $D/train_$1.log | cut -c1-200
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
train 1-tree $PWD/src
[ $SECONDS -lt 380 ] && train 2-base $PWD/.device-carry/s27/base/src
[ $SECONDS -lt 470 ] && { MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 110 python3 -m pytest -q -rf \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -2 $D/gpu_smoke_fast.log; }
save
