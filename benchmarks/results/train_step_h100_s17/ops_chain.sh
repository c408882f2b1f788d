#!/usr/bin/env bash
# benchmarks/step_ops.py (per-op GPU time of the compiled, not graphed, nam56r-350m step) for
# each tree, in order, each in its own process; trees as in chain.sh (a commit unpacked under
# .device-carry/s17/C with its benchmarks/step_ops.py, or "." for the working tree).
# Results go to DIR, tar'ed into $OUT.
#   usage: ops_chain.sh DIR TREE...
set -u
D=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p "$D"
i=0
for T in "$@"; do
    i=$((i + 1)); name="$i-${T:0:7}"; [ "$T" = . ] && name="$i-tree"
    root=$PWD; [ "$T" != . ] && root=$PWD/.device-carry/s17/$T
    (cd "$root" && PYTHONPATH=$root/src:/tmp/site python3 benchmarks/step_ops.py \
        --preset nam56r-350m --seq-len 2048 --kernels fast --rows 80 --out "$D/$name" \
        > "$D/$name.log" 2>&1)
    echo "$name $(head -1 "$D/$name/step_ops.txt" 2>/dev/null)"
done
tar czf "$OUT/$(basename "$D").tgz" -C "$(dirname "$D")" "$(basename "$D")"
