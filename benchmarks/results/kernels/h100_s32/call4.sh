#!/usr/bin/env bash
# Session 32, call 4 (carry .whl: mamba_ssm 2.3.2.post1 built as the issue says,
# liger-kernel 0.8.5, fla-core / flash-linear-attention 0.6.0, datasketch): benchmarks/kernels.py
# at this tree (host arithmetic as plain ints) for every surface but Mamba-3, in one process.
#   usage: bash benchmarks/results/kernels/h100_s32/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/s32_call4; mkdir -p $D
save() { tar czf "$OUT/s32_call4.tgz" -C /tmp s32_call4; }
timeout 560 python3 benchmarks/kernels.py --name kernels_h100_s32 --out $D \
    --surfaces rmsnorm,linear_cross_entropy,moe_experts,attention,document_attention,short_conv,gated_delta,muon_polynomial \
    > $D/kernels_h100_s32.log 2>&1
echo "exit $?"; grep -v "^{" $D/kernels_h100_s32.log | grep -v "Warn\|warn" | tail -40
save
