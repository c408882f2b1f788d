#!/usr/bin/env bash
# The final call of session 17 (working tree): hybrid and dense Llama, compiled and compiled +
# CUDA graph, in one process; then a 4-iteration profiled run of the hybrid with its kernel
# families. Results go to DIR, tar'ed into $OUT.   usage: final.sh DIR NAME
set -u
D=$1; N=$2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
mkdir -p "$D"
A="--preset nam56r-350m --seq-len 2048 --kernels fast"
python3 benchmarks/train_step.py $A --models hybrid llama --modes compiled compiled-graphed \
    --out "$D/$N.json" > "$D/$N.log" 2>&1; grep "L=2048" "$D/$N.log"
python3 benchmarks/train_step.py $A --models hybrid --modes compiled-graphed --profile "$D/prof" \
    --iters 4 --out "$D/${N}_profiled.json" > "$D/${N}_profiled.log" 2>&1
grep -A3 "^family" "$D/${N}_profiled.log"; grep "total GPU\|L=2048" "$D/${N}_profiled.log"
tar czf "$OUT/$(basename "$D").tgz" -C "$(dirname "$D")" "$(basename "$D")"
