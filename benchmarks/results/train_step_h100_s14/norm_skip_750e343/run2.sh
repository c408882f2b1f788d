set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/x
echo "commit $(cat $S/commit)"
ARGS="--preset nam56r-350m --seq-len 2048 --kernels fast"
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/x/old_a6d8829.json > /tmp/x/old_a6d8829.log 2>&1); grep "L=2048" /tmp/x/old_a6d8829.log
python3 benchmarks/train_step.py $ARGS --models hybrid llama --modes compiled compiled-graphed --out /tmp/x/new_750e343.json > /tmp/x/new_750e343.log 2>&1; grep "L=2048\|peak" /tmp/x/new_750e343.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --out /tmp/x/old2_a6d8829.json > /tmp/x/old2_a6d8829.log 2>&1); grep "L=2048" /tmp/x/old2_a6d8829.log
python3 benchmarks/train_step.py $ARGS --models hybrid --modes compiled-graphed --iters 4 --profile /tmp/x/prof --out /tmp/x/new_750e343_profiled.json > /tmp/x/new_750e343_profiled.log 2>&1; grep -A20 "ms/step" /tmp/x/new_750e343_profiled.log | head -22
tar czf $OUT/x.tgz -C /tmp x
