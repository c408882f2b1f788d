python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/u; C=$(cut -c1-7 $S/commit)
python3 -m pytest -q tests/kernels/test_ops_triton.py -m gpu 2>&1 | tail -3 | tee /tmp/u/gpu_tests_$C.log
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/u/old_bb94538.json > /tmp/u/old_bb94538.log 2>&1); grep "L=2048" /tmp/u/old_bb94538.log
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed --out /tmp/u/new_$C.json > /tmp/u/new_$C.log 2>&1; grep "L=2048\|peak" /tmp/u/new_$C.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/u/old2_bb94538.json > /tmp/u/old2_bb94538.log 2>&1); grep "L=2048" /tmp/u/old2_bb94538.log
(cd $S/old0 && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/u/old_a6d8829.json > /tmp/u/old_a6d8829.log 2>&1); grep "L=2048" /tmp/u/old_a6d8829.log
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 --profile /tmp/u/prof --out /tmp/u/new_${C}_profiled.json > /tmp/u/new_${C}_profiled.log 2>&1; grep -A16 "ms/step" /tmp/u/new_${C}_profiled.log | head -17
tar czf $OUT/u.tgz -C /tmp u
