#!/usr/bin/env bash
# Session 25, first device call (carry .whl; needs 1fd0ad7's tree, where the side stream exists): the GPU tests of the side stream and of the code
# it touches, the side-stream probe (side_stream_probe.py), then the nam56r-350m training step
# (hybrid, compiled + CUDA graph, fast kernels) with the side stream off and on, alternately,
# each in its own process.   usage: bash benchmarks/results/kernels/h100_s25/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
D=/tmp/s25_call1; mkdir -p $D/step
python3 -m pytest -q -rf tests/kernels/test_streams.py tests/kernels/test_moe_grouped.py \
    tests/kernels/test_mamba3_triton.py tests/model/test_moe.py > $D/gpu_tests.log 2>&1
tail -4 $D/gpu_tests.log
python3 benchmarks/results/kernels/h100_s25/side_stream_probe.py $D/side_stream_probe.json \
    > $D/side_stream_probe.log 2>&1
grep "^{" $D/side_stream_probe.log | cut -c1-200; tail -2 $D/side_stream_probe.log | cut -c1-300
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast --models hybrid --modes compiled-graphed"
i=0
for S in 0 1 0 1; do
    i=$((i + 1)); name="$i-side$S"
    MEGACPP_SIDE_STREAM=$S python3 benchmarks/train_step.py $ARGS --out "$D/step/$name.json" \
        > "$D/step/$name.log" 2>&1 || true
    echo "$name $(grep "L=2048" "$D/step/$name.log")"
done
tar czf "$OUT/s25_call1.tgz" -C /tmp s25_call1
