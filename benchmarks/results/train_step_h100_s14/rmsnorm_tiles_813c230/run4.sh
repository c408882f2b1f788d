python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/z; C=$(cut -c1-7 $S/commit)
echo "commit $C"; python3 -c "import torch; from megacpp.train.parallelize import inductor_options as o; print(torch.__version__, o())"
python3 -m pytest -q tests/kernels/test_ops_triton.py tests/train/test_parallelize.py 2>&1 | tail -3 | tee /tmp/z/gpu_tests_$C.log
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/z/old_750e343.json > /tmp/z/old_750e343.log 2>&1); grep "L=2048" /tmp/z/old_750e343.log
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed --out /tmp/z/new_$C.json > /tmp/z/new_$C.log 2>&1; grep "L=2048\|peak" /tmp/z/new_$C.log
python3 $S/cat8.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/z/new_cat8_$C.json > /tmp/z/new_cat8_$C.log 2>&1; grep "L=2048" /tmp/z/new_cat8_$C.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/z/old2_750e343.json > /tmp/z/old2_750e343.log 2>&1); grep "L=2048" /tmp/z/old2_750e343.log
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 --profile /tmp/z/prof --out /tmp/z/new_${C}_profiled.json > /tmp/z/new_${C}_profiled.log 2>&1; grep -A16 "ms/step" /tmp/z/new_${C}_profiled.log | head -17
tar czf $OUT/z.tgz -C /tmp z
