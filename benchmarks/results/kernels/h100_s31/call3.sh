#!/usr/bin/env bash
# Session 31, third device call (carry .whl): the Mamba-3 bench rows at this tree (ours,
# mamba_ssm 2.3.2.post1; the reference at L 4096 only), then the training-step benchmark,
# hybrid and dense Llama in one process (compiled, and compiled + CUDA graphs).
#   usage: bash benchmarks/results/kernels/h100_s31/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
D=/tmp/s31_call3; mkdir -p $D
save() { tar czf "$OUT/s31_call3.tgz" -C /tmp s31_call3; }
timeout 150 python3 benchmarks/kernels.py --surfaces mamba3_scan --cases seq4096 --name mamba3_h100_s31_seq4096 \
    --out $D > $D/seq4096.log 2>&1; echo "exit $?"; grep -v "^{" $D/seq4096.log | tail -5; save
timeout 120 python3 benchmarks/kernels.py --surfaces mamba3_scan --cases seq8192 --backends triton_chunked,mamba_ssm \
    --name mamba3_h100_s31_seq8192 --out $D > $D/seq8192.log 2>&1; echo "exit $?"; grep -v "^{" $D/seq8192.log | tail -4; save
timeout 300 python3 benchmarks/train_step.py --preset nam56r-350m --seq-len 2048 --kernels fast \
    --models hybrid llama --modes compiled compiled-graphed --out $D/train_step_s31.json > $D/train_step_s31.log 2>&1
echo "exit $?"; grep "L=2048\|peak\|MFU" $D/train_step_s31.log | tail -12; save
