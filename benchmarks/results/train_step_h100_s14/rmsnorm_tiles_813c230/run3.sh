python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
S=.device-carry/s14; mkdir -p /tmp/y
python3 $S/norm_probe.py /tmp/y/norm_probe.json 2>&1 | tee /tmp/y/norm_probe.log
TORCH_LOGS=output_code python3 $S/mblock_code.py > /tmp/y/mblock_code.log 2>&1; tail -2 /tmp/y/mblock_code.log; wc -c /tmp/y/mblock_code.log
tar czf $OUT/y.tgz -C /tmp y
