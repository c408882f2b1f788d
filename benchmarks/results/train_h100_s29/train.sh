# Session 29 (as session 28): `train NAME SRC` runs `megacpp train` (train_350m.toml, fast kernels, compile +
# CUDA graphs) from SRC and prints the median of steps 9-30; sourced by the callN.sh scripts
# (which set D, the output folder, and save).
train() {  # $1 = run name, $2 = src
    MEGACPP_KERNELS=fast PYTHONPATH=$2 timeout 150 python3 -m megacpp train \
        --config benchmarks/results/train_h100_s29/train_350m.toml --no-progress \
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
}
