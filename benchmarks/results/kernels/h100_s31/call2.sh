#!/usr/bin/env bash
# Session 31, second device call (carry .whl: mamba_ssm 2.3.2.post1 built as the issue says,
# liger-kernel 0.8.5, fla-core / flash-linear-attention 0.6.0, datasketch): benchmarks/kernels.py
# at this tree for every surface but Mamba-3, in one process (Mamba-3's rows: call 3).
#   usage: bash benchmarks/results/kernels/h100_s31/call2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/s31_call2; mkdir -p $D
save() { tar czf "$OUT/s31_call2.tgz" -C /tmp s31_call2; }
timeout 560 python3 benchmarks/kernels.py --name kernels_h100_s31 --out $D \
    --surfaces rmsnorm,linear_cross_entropy,moe_experts,attention,document_attention,short_conv,gated_delta,muon_polynomial \
    > $D/kernels_h100_s31.log 2>&1
echo "exit $?"; grep -v "^{" $D/kernels_h100_s31.log | grep -v "Warn\|warn" | tail -40
save
