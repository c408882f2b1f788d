python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/v; C=$(cut -c1-7 $S/commit)
python3 -m pytest -q tests/kernels/test_ops_triton.py tests/model tests/train/test_cuda_graph.py tests/train/test_parallelize.py -m gpu 2>&1 | tail -3 | tee /tmp/v/gpu_tests_$C.log
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/v/old_bc1eecc.json > /tmp/v/old_bc1eecc.log 2>&1); grep "L=2048" /tmp/v/old_bc1eecc.log
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed --out /tmp/v/new_$C.json > /tmp/v/new_$C.log 2>&1; grep "L=2048\|peak" /tmp/v/new_$C.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/v/old2_bc1eecc.json > /tmp/v/old2_bc1eecc.log 2>&1); grep "L=2048" /tmp/v/old2_bc1eecc.log
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 --profile /tmp/v/prof --out /tmp/v/new_${C}_profiled.json > /tmp/v/new_${C}_profiled.log 2>&1; grep -A16 "ms/step" /tmp/v/new_${C}_profiled.log | head -17
tar czf $OUT/v.tgz -C /tmp v
