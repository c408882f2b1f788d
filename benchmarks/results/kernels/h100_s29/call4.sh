#!/usr/bin/env bash
# Session 29, fourth device call (carry .whl): FlexAttention launch settings for the document
# attention at the nam56r step's shape, 2 and 8 documents a row (flex_sweep.py).
#   usage: bash benchmarks/results/kernels/h100_s29/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
D=/tmp/s29_call4; mkdir -p $D
for docs in 2 8; do
    PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 280 python3 benchmarks/results/kernels/h100_s29/flex_sweep.py \
        $D/flex_sweep_docs$docs.json --docs $docs > $D/flex_sweep_docs$docs.log 2>&1
    echo "== docs $docs"; grep -v -i warn $D/flex_sweep_docs$docs.log | tail -20 | cut -c1-200
done
tar czf "$OUT/s29_call4.tgz" -C /tmp s29_call4
