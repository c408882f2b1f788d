#!/usr/bin/env bash
# Session 27, fourth device call (carry .whl and .device-carry/s27 as in call1.sh), this tree
# (flex chosen, the mask from document_block_tiles): the CUDA-graph trainer and model GPU tests
# (default kernel mode), the document_attention bench row, `megacpp train` on 3929c77 and this
# tree once more, then session 26's trainer_profile.py on this tree while time lasts.
#   usage: bash benchmarks/results/train_h100_s27/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s27_call4; mkdir -p $D
save() { tar czf "$OUT/s27_call4.tgz" -C /tmp s27_call4; }
PYTHONPATH=$PWD/src:/tmp/site timeout 130 python3 -m pytest -q -rf -m gpu tests/train/test_cuda_graph.py \
    tests/model > $D/gpu_tests.log 2>&1; tail -2 $D/gpu_tests.log
PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 $R/../kernels.py --surfaces document_attention \
    --name doc_attention_h100_s27 --out $D/bench > $D/bench.log 2>&1; tail -6 $D/bench.log | cut -c1-200
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
train 3-base $PWD/.device-carry/s27/base/src
train 4-tree $PWD/src
[ $SECONDS -lt 400 ] && { MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout $((580 - SECONDS)) \
    python3 $R/train_h100_s26/trainer_profile.py $D/trainer_profile.json run.out_dir=/tmp/runs/profile \
    data.dir=.device-carry/s27/data/libstdcxx-32k > $D/trainer_profile.log 2>&1
    grep -v "Warning\|warn" $D/trainer_profile.log | tail -30; rm -rf /tmp/runs/profile/checkpoints; }
save
