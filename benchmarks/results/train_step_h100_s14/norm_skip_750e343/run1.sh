set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/x
echo "commit $(cat $S/commit)"; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python3 -m pytest -q -x tests/kernels/test_ops_triton.py -k "rmsnorm or model_auto" 2>&1 | tail -5 | tee /tmp/x/gpu_tests_rmsnorm.log
python3 $S/explain.py > /tmp/x/explain.log 2>&1; tail -40 /tmp/x/explain.log
python3 benchmarks/train_step.py --preset nam56r-350m --seq-len 2048 --models hybrid llama --modes compiled compiled-graphed --kernels fast --out /tmp/x/new.json 2>&1 | grep -v Warning | tail -8 | tee /tmp/x/new.log
(cd $S/old && PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/train_step.py --preset nam56r-350m --seq-len 2048 --models hybrid --modes compiled-graphed --kernels fast --out /tmp/x/old.json 2>&1 | grep -v Warning | tail -4) | tee /tmp/x/old.log
python3 benchmarks/train_step.py --preset nam56r-350m --seq-len 2048 --models hybrid --modes compiled-graphed --kernels fast --out /tmp/x/new2.json 2>&1 | grep -v Warning | tail -3 | tee /tmp/x/new2.log
tar czf $OUT/x.tgz -C /tmp x
