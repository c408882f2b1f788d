#!/usr/bin/env bash
# Session 27, second device call (carry .whl and .device-carry/s27 as in call1.sh): the block
# mask's tensors now [B, 1, ...] from the start. flex_layout_probe.py (four constructions traced
# with FlexAttention), once more for call 1's construction alone with Inductor's output code
# logged, the document-attention GPU tests, then `megacpp train` (this tree, flex chosen, and
# 3929c77) and the GPU smoke tests under fast kernels.
#   usage: bash benchmarks/results/train_h100_s27/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s27_call2; mkdir -p $D
save() { tar czf "$OUT/s27_call2.tgz" -C /tmp s27_call2; }
PYTHONPATH=$PWD/src timeout 200 python3 $R/train_h100_s27/flex_layout_probe.py $D/flex_layout_probe.json \
    > $D/flex_layout_probe.log 2>&1; grep "^[a-z_0-9]* {" $D/flex_layout_probe.log | cut -c1-300
save
TORCH_LOGS=output_code PYTHONPATH=$PWD/src timeout 100 python3 $R/train_h100_s27/flex_layout_probe.py \
    --only unsqueezed $D/unsqueezed_only.json > $D/unsqueezed_output_code.log 2>&1
grep -n "stride_kv_idx\|stride_kv_num\|KV_NUM_BLKS\b.*stride\|assert_size_stride(arg.*, (2, 1, 16" \
    $D/unsqueezed_output_code.log | head -20
save
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    > $D/gpu_tests.log 2>&1; tail -2 $D/gpu_tests.log
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
[ $SECONDS -lt 400 ] && train 2-base $PWD/.device-carry/s27/base/src
[ $SECONDS -lt 480 ] && { MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 110 python3 -m pytest -q -rf \
    tests/train/test_gpu_smoke.py > $D/gpu_smoke_fast.log 2>&1; tail -2 $D/gpu_smoke_fast.log; }
save
