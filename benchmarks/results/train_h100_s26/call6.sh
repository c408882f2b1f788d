#!/usr/bin/env bash
# Session 26, sixth device call (carry .whl and .device-carry/s26, with muon/ = 2123b32's src and
# configs: `git archive 2123b32 src configs | tar x -C .device-carry/s26/muon`): the GPU tests of
# the document_attention surface and of the trainer (graphed, fast kernels, packed rows), its
# bench rows, then `megacpp train` (as in call1.sh) on 2123b32 (Muon's change, masked SDPA) and
# this tree (FlexAttention), alternately while time lasts.
#   usage: bash benchmarks/results/train_h100_s26/call6.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 MEGACPP_KERNELS=fast
D=/tmp/s26_call6; mkdir -p $D
PYTHONPATH=$PWD/src:/tmp/site timeout 240 python3 -m pytest -q -rf tests/kernels/test_document_attention.py \
    tests/model/test_attention.py tests/train/test_cuda_graph.py tests/train/test_gpu_smoke.py \
    > $D/gpu_tests.log 2>&1; tail -3 $D/gpu_tests.log
PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 benchmarks/kernels.py --surfaces document_attention \
    --name doc_attention_h100_s26 --out $D/bench > $D/bench.log 2>&1; tail -8 $D/bench.log | cut -c1-200
CFG=benchmarks/results/train_h100_s26/train_350m.toml
i=0
for T in muon tree muon tree; do
    i=$((i + 1)); name="$i-$T"
    src=$PWD/src; [ "$T" != tree ] && src=$PWD/.device-carry/s26/$T/src
    PYTHONPATH=$src timeout 200 python3 -m megacpp train --config $CFG --no-progress \
        --set parallel.compile=true --set parallel.cuda_graph=true --set run.out_dir=/tmp/runs/$name \
        > $D/train_$name.log 2>&1
    cp /tmp/runs/$name/metrics.jsonl $D/metrics_$name.jsonl; cp /tmp/runs/$name/receipt.json $D/receipt_$name.json
    rm -rf /tmp/runs/$name/checkpoints
    echo "$name $(python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open('$D/metrics_$name.jsonl') if '\"train\"' in l]
t = [r['time_s'] for r in rows if r['step'] >= 9]
print(f'steps 9-30 median {1e3 * statistics.median(t):.1f} ms, {16384 / statistics.median(t):,.0f} tokens/s, loss {rows[-1][\"loss\"]:.4f}')
" 2>&1 | tail -1)"
    [ $SECONDS -gt 380 ] && break
done
tar czf "$OUT/s26_call6.tgz" -C /tmp s26_call6
