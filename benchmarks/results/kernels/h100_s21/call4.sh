#!/usr/bin/env bash
# Session 21, fourth device call (carry .whl): the training step at the tree, hybrid and dense
# Llama in one process (final.sh's first run, no profile), then the Mamba-3 bench rows
# (ours, mamba_ssm 2.3.2.post1; the reference at L 4096 only).
#   usage: bash benchmarks/results/kernels/h100_s21/call4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=$OUT/final_s21; mkdir -p "$D"
A="--preset nam56r-350m --seq-len 2048 --kernels fast"
python3 benchmarks/train_step.py $A --models hybrid llama --modes compiled compiled-graphed \
    --out "$D/final_s21.json" > "$D/final_s21.log" 2>&1; grep "L=2048" "$D/final_s21.log"
tar czf "$OUT/final_s21.tgz" -C "$OUT" final_s21
M=$OUT/mamba3_s21; mkdir -p "$M"
python3 benchmarks/kernels.py --surfaces mamba3_scan --cases seq4096 --name mamba3_h100_s21_seq4096 \
    --out "$M" > "$M/seq4096.log" 2>&1; tail -5 "$M/seq4096.log"
tar czf "$OUT/mamba3_s21.tgz" -C "$OUT" mamba3_s21
python3 benchmarks/kernels.py --surfaces mamba3_scan --cases seq8192 --backends triton_chunked,mamba_ssm \
    --name mamba3_h100_s21_seq8192 --out "$M" > "$M/seq8192.log" 2>&1; tail -4 "$M/seq8192.log"
tar czf "$OUT/mamba3_s21.tgz" -C "$OUT" mamba3_s21
