# Session 30: `train NAME SRC [KEY=VALUE ...]` runs `megacpp train` from SRC with session 29's
# train_350m.toml (nam56r-350m, fast kernels, compile + CUDA graphs), its data read from
# .device-carry/s30, and prints the median of steps 9-30. Sourced by the callN.sh scripts, which
# set D (the output folder).
train() {  # $1 = run name, $2 = src, then --set overrides
    local name=$1 src=$2; shift 2
    local sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
    MEGACPP_KERNELS=fast PYTHONPATH=$src timeout 240 python3 -m megacpp train \
        --config benchmarks/results/train_h100_s29/train_350m.toml --no-progress \
        --set data.dir=.device-carry/s30/data/libstdcxx-32k \
        --set parallel.compile=true --set parallel.cuda_graph=true --set run.out_dir=/tmp/runs/$name \
        "${sets[@]}" > $D/train_$name.log 2>&1
    echo "exit $?"
    cp /tmp/runs/$name/metrics.jsonl $D/metrics_$name.jsonl; cp /tmp/runs/$name/receipt.json $D/receipt_$name.json
    rm -rf /tmp/runs/$name/checkpoints
    echo "$name $(python3 $(dirname ${BASH_SOURCE[0]})/summary.py $D/metrics_$name.jsonl)"
    grep -c "recompile_limit" $D/train_$name.log | sed 's/^/  recompile-limit warnings: /'
}
