python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/w; C=$(cut -c1-7 $S/commit)
python3 -m pytest -q tests/model/test_mamba3.py tests/train/test_parallelize.py tests/kernels/test_ops_triton.py::test_model_auto_mode_matches_reference_mode 2>&1 | tail -3 | tee /tmp/w/gpu_tests_$C.log
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/w/old_813c230.json > /tmp/w/old_813c230.log 2>&1); grep "L=2048" /tmp/w/old_813c230.log
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed --out /tmp/w/new_$C.json > /tmp/w/new_$C.log 2>&1; grep "L=2048\|peak" /tmp/w/new_$C.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/w/old2_813c230.json > /tmp/w/old2_813c230.log 2>&1); grep "L=2048" /tmp/w/old2_813c230.log
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 --profile /tmp/w/prof --out /tmp/w/new_${C}_profiled.json > /tmp/w/new_${C}_profiled.log 2>&1; grep -A16 "ms/step" /tmp/w/new_${C}_profiled.log | head -17
tar czf $OUT/w.tgz -C /tmp w
