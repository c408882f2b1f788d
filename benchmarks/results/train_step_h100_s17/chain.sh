#!/usr/bin/env bash
# One device call of session 17: the GPU tests named after "--", then the nam56r-350m training
# step (hybrid, compiled + CUDA graph, fast kernels) of each tree in TREES, in order, each in
# its own process. A tree is a commit unpacked beforehand on this machine with
#   git archive C src configs benchmarks/train_step.py | tar x -C .device-carry/s17/C
# ("." is the working tree). Results go to DIR, tar'ed into $OUT.
#   usage: chain.sh DIR TREE... [-- PYTEST ARGS]
set -u
D=$1; shift
TREES=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do TREES+=("$1"); shift; done
[ $# -gt 0 ] && shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
mkdir -p "$D"
[ $# -gt 0 ] && python3 -m pytest -q -rf "$@" > "$D/gpu_tests.log" 2>&1; tail -4 "$D/gpu_tests.log"
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast --models hybrid --modes compiled-graphed"
i=0
for T in "${TREES[@]}"; do
    i=$((i + 1)); name="$i-${T:0:7}"; [ "$T" = . ] && name="$i-tree"
    root=$PWD; [ "$T" != . ] && root=$PWD/.device-carry/s17/$T
    (cd "$root" && PYTHONPATH=$root/src:/tmp/site python3 benchmarks/train_step.py $ARGS \
        --out "$D/$name.json" > "$D/$name.log" 2>&1)
    echo "$name $(grep "L=2048" "$D/$name.log")"
done
tar czf "$OUT/$(basename "$D").tgz" -C "$(dirname "$D")" "$(basename "$D")"
