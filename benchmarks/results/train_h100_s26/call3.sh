#!/usr/bin/env bash
# Session 26, third device call (carry .device-carry/s26 as in call1.sh; this tree has the
# "diagonal" Newton-Schulz): the trainer's and the optimizer's GPU tests, then `megacpp train`
# (as in call1.sh) on session 25's tree and this one, alternately, each in its own process.
#   usage: bash benchmarks/results/train_h100_s26/call3.sh
set -u
export PYTHONUNBUFFERED=1 MEGACPP_KERNELS=fast
D=/tmp/s26_call3; mkdir -p $D
PYTHONPATH=$PWD/src timeout 240 python3 -m pytest -q -rf -m gpu tests/train/test_optim.py \
    tests/train/test_cuda_graph.py tests/train/test_gpu_smoke.py tests/kernels/test_profiling.py \
    > $D/gpu_tests.log 2>&1; tail -3 $D/gpu_tests.log
CFG=benchmarks/results/train_h100_s26/train_350m.toml
i=0
for T in base tree base tree; do
    i=$((i + 1)); name="$i-$T"
    src=$PWD/src; [ "$T" = base ] && src=$PWD/.device-carry/s26/base/src
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
    [ $SECONDS -gt 430 ] && break
done
tar czf "$OUT/s26_call3.tgz" -C /tmp s26_call3
