#!/usr/bin/env bash
# Session 21, first device call (carry .whl: mamba_ssm 2.3.2.post1 built as the issue says,
# liger-kernel 0.8.5, fla-core / flash-linear-attention 0.6.0, datasketch, tree-sitter):
# the kernel bench at the working tree for every surface but Mamba-3 (its rows: call 2), then
# session 15's MoE host probe at both MoE cases.   usage: bash .../h100_s21/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=$OUT/s21_call1; mkdir -p "$D"
git rev-parse HEAD > "$D/commit.txt" 2>/dev/null; git status --short >> "$D/commit.txt" 2>/dev/null
python3 benchmarks/kernels.py --name kernels_h100_s21 --out "$D" \
    --surfaces rmsnorm,linear_cross_entropy,moe_experts,attention,short_conv,gated_delta \
    > "$D/kernels_h100_s21.log" 2>&1
tail -25 "$D/kernels_h100_s21.log"
python3 benchmarks/results/kernels/h100_s15/moe_host_probe.py "$D" > "$D/moe_host_probe.log" 2>&1
grep -v timeline "$D/moe_host_probe.log" | cut -c1-300
tar czf "$OUT/s21_call1.tgz" -C "$OUT" s21_call1
