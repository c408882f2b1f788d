#!/usr/bin/env bash
# Session 22, second device call (carry .whl and .device-carry with c9af883 unpacked): the
# training step of c9af883 (the MoE on permuted copies) and of the tree with the MoE's
# expert-sorted operands read through the plan by all their consumers / the two GEMMs only /
# the GEMMs and dw_out (moe_variant_step.py), in one order and then the reverse.
#   usage: bash benchmarks/results/kernels/h100_s22/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
D=/tmp/ab_s22b; mkdir -p $D
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast --models hybrid --modes compiled-graphed"
i=0
for V in c9af883 all mm mm_dwout mm_dwout mm all c9af883; do
    i=$((i + 1)); name="$i-$V"
    if [ "$V" = c9af883 ]; then
        root=$PWD/.device-carry/s17/$V
        (cd "$root" && PYTHONPATH=$root/src:/tmp/site python3 benchmarks/train_step.py $ARGS \
            --out "$D/$name.json" > "$D/$name.log" 2>&1)
    else
        PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/results/kernels/h100_s22/moe_variant_step.py \
            "$V" $ARGS --out "$D/$name.json" > "$D/$name.log" 2>&1
    fi
    echo "$name $(grep "L=2048" "$D/$name.log")"
done
tar czf "$OUT/$(basename "$D").tgz" -C "$(dirname "$D")" "$(basename "$D")"
