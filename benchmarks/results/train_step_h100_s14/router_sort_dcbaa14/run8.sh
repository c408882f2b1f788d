python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/t; C=$(cut -c1-7 $S/commit)
python3 -m pytest -q tests/model/test_moe.py tests/infer tests/kernels/test_ops_triton.py tests/kernels/test_moe_grouped.py -m gpu 2>&1 | tail -3 | tee /tmp/t/gpu_tests_$C.log
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/t/old_839124f.json > /tmp/t/old_839124f.log 2>&1); grep "L=2048" /tmp/t/old_839124f.log
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed --out /tmp/t/new_$C.json > /tmp/t/new_$C.log 2>&1; grep "L=2048\|peak" /tmp/t/new_$C.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/t/old2_839124f.json > /tmp/t/old2_839124f.log 2>&1); grep "L=2048" /tmp/t/old2_839124f.log
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 --profile /tmp/t/prof --out /tmp/t/new_${C}_profiled.json > /tmp/t/new_${C}_profiled.log 2>&1; grep -A16 "ms/step" /tmp/t/new_${C}_profiled.log | head -17
tar czf $OUT/t.tgz -C /tmp t
