#!/usr/bin/env bash
# Session 31, fourth device call (carry .whl): the Mamba-3 bench rows at this tree (ours,
# mamba_ssm 2.3.2.post1; the reference at L 4096 only): call 3 gave them 150 and 120 s, which
# a cold Triton cache did not fit (no row printed).
#   usage: bash benchmarks/results/kernels/h100_s31/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/s31_call4; mkdir -p $D
save() { tar czf "$OUT/s31_call4.tgz" -C /tmp s31_call4; }
timeout 330 python3 benchmarks/kernels.py --surfaces mamba3_scan --cases seq4096 --name mamba3_h100_s31_seq4096 \
    --out $D > $D/seq4096.log 2>&1; echo "exit $?"; grep -v "^{" $D/seq4096.log | tail -5; save
timeout 220 python3 benchmarks/kernels.py --surfaces mamba3_scan --cases seq8192 --backends triton_chunked,mamba_ssm \
    --name mamba3_h100_s31_seq8192 --out $D > $D/seq8192.log 2>&1; echo "exit $?"; grep -v "^{" $D/seq8192.log | tail -4; save
save
