#!/usr/bin/env bash
# Session 32, call 6: the kernels GPU tests at this tree (call 5's run stopped at its 300 s
# limit, all passing until then): every module but Mamba-3's, then Mamba-3's with what is left.
#   usage: bash benchmarks/results/kernels/h100_s32/call6.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
D=/tmp/s32_call6; mkdir -p $D
save() { tar czf "$OUT/s32_call6.tgz" -C /tmp s32_call6; }
timeout 400 python3 -m pytest -q tests/kernels --deselect tests/kernels/test_mamba3_triton.py -k "not mamba3" > $D/gpu_tests_kernels.log 2>&1
echo "tests exit $?"; tail -3 $D/gpu_tests_kernels.log; save
timeout 170 python3 -m pytest -q tests/kernels/test_mamba3_triton.py > $D/gpu_tests_mamba3.log 2>&1
echo "mamba3 tests exit $?"; tail -3 $D/gpu_tests_mamba3.log; save
