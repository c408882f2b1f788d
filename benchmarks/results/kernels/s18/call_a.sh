#!/usr/bin/env bash
# Session 18, device call A: the MoE / amp / catalog / compile GPU tests, the wgrad probe, and
# the kernel benchmark's moe_experts, rmsnorm and attention rows, all at the working tree.
# Results in $OUT/a.tgz.   usage: bash benchmarks/results/kernels/s18/call_a.sh  (carry .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
D=$OUT/a; mkdir -p "$D"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv > "$D/gpu.txt"
python3 -m pytest -q -rf tests/kernels/test_moe_grouped.py tests/kernels/test_amp.py \
    tests/kernels/test_catalog.py tests/kernels/test_triton_compile.py tests/model/test_moe.py \
    > "$D/gpu_tests.log" 2>&1; tail -3 "$D/gpu_tests.log"
python3 benchmarks/results/kernels/s18/wgrad_probe.py "$D" > "$D/wgrad_probe.log" 2>&1
tail -9 "$D/wgrad_probe.log"
python3 benchmarks/kernels.py --surfaces moe_experts,rmsnorm,attention --name kernels_s18 \
    --out "$D/bench" > "$D/bench.log" 2>&1; tail -14 "$D/bench.log"
tar czf "$OUT/a.tgz" -C "$OUT" a && rm -rf "$D"
