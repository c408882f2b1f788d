#!/usr/bin/env bash
# Session 26, first device call (carry .device-carry/s26: the dataset, built here with
#   megacpp data build /usr/include/c++/12 --config configs/data/cpp.toml --out .device-carry/s26/data/libstdcxx-32k
# and session 25's tree, `git archive 0065a9e src configs | tar x -C .device-carry/s26/base`):
# the GPU tests of what changed, the optimizer probe (optim_probe.py: Muon's old and new
# Newton-Schulz alternately), then `megacpp train` (nam56r-350m, compile + CUDA graphs, 30
# steps) on session 25's tree and this one, alternately, each in its own process.
#   usage: bash benchmarks/results/train_h100_s26/call1.sh
set -u
export PYTHONUNBUFFERED=1 MEGACPP_KERNELS=fast
D=/tmp/s26_call1; mkdir -p $D
PYTHONPATH=$PWD/src python3 -m pytest -q -rf -m gpu tests/train/test_optim.py tests/kernels/test_profiling.py \
    > $D/gpu_tests.log 2>&1; tail -3 $D/gpu_tests.log
PYTHONPATH=$PWD/src python3 benchmarks/results/train_h100_s26/optim_probe.py $D/optim_probe.json \
    > $D/optim_probe.log 2>&1; grep -v "^  \[" $D/optim_probe.log | grep "^{\|Error" | cut -c1-220
CFG=benchmarks/results/train_h100_s26/train_350m.toml
i=0
for T in base tree base tree; do
    i=$((i + 1)); name="$i-$T"
    src=$PWD/src; [ "$T" = base ] && src=$PWD/.device-carry/s26/base/src
    PYTHONPATH=$src timeout 240 python3 -m megacpp train --config $CFG --no-progress \
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
    [ $i -ge 2 ] && [ $SECONDS -gt 480 ] && break
done
tar czf "$OUT/s26_call1.tgz" -C /tmp s26_call1
