#!/usr/bin/env bash
# One A/B device call of session 14 (runs 5, 6 and 8), from the repository root on the GPU
# machine: the GPU tests named in the arguments, then the training step of the parent's tree
# (`git archive PARENT src configs benchmarks/train_step.py` unpacked under
# .device-carry/s14/old), this tree with the Llama peer, the parent again, and this tree under
# the profiler. Results go to DIR (tar'ed into $OUT). The calls were:
#   run 5: ab.sh 813c230 /tmp/w tests/model/test_mamba3.py tests/train/test_parallelize.py \
#              tests/kernels/test_ops_triton.py::test_model_auto_mode_matches_reference_mode
#   run 6: ab.sh bc1eecc /tmp/v tests/kernels/test_ops_triton.py tests/model \
#              tests/train/test_cuda_graph.py tests/train/test_parallelize.py -m gpu
#   run 8: ab.sh 839124f /tmp/t tests/model/test_moe.py tests/infer tests/kernels/test_ops_triton.py \
#              tests/kernels/test_moe_grouped.py -m gpu
set -u
PARENT=$1 D=$2
shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=${S:-.device-carry/s14}; mkdir -p "$D"; C=$(cut -c1-7 $S/commit)
python3 -m pytest -q "$@" 2>&1 | tail -3 | tee "$D/gpu_tests_$C.log"
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
parent() {  # $1: output name
    (cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS \
        --models hybrid --modes compiled-graphed --out "$D/$1.json" > "$D/$1.log" 2>&1)
    grep "L=2048" "$D/$1.log"
}
parent "old_$PARENT"
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed \
    --out "$D/new_$C.json" > "$D/new_$C.log" 2>&1; grep "L=2048\|peak" "$D/new_$C.log"
parent "old2_$PARENT"
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 \
    --profile "$D/prof" --out "$D/new_${C}_profiled.json" > "$D/new_${C}_profiled.log" 2>&1
grep -A16 "ms/step" "$D/new_${C}_profiled.log" | head -17
tar czf "$OUT/$(basename "$D").tgz" -C "$(dirname "$D")" "$(basename "$D")"
