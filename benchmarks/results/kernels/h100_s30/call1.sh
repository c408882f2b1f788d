#!/usr/bin/env bash
# Session 30, first device call (carry .whl and .device-carry/s30): the Newton-Schulz probe
# (symmetric Triton products against cuBLAS), then session 26's trainer profile at this tree.
#   usage: bash benchmarks/results/kernels/h100_s30/call1.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=benchmarks/results; D=/tmp/s30_call1; mkdir -p $D
save() { tar czf "$OUT/s30_call1.tgz" -C /tmp s30_call1; }
PYTHONPATH=$PWD/src:/tmp/site timeout 240 python3 $R/kernels/h100_s30/ns_probe.py $D/ns_probe.json > $D/ns_probe.log 2>&1
echo "ns_probe exit $?"; grep -v "^W1\|warn" $D/ns_probe.log | cut -c1-400 | tail -40; save
MEGACPP_KERNELS=fast PYTHONPATH=$PWD/src:/tmp/site timeout 200 \
    python3 $R/train_h100_s26/trainer_profile.py $D/trainer_profile.json run.out_dir=/tmp/runs/profile \
    data.dir=.device-carry/s30/data/libstdcxx-32k > $D/trainer_profile.log 2>&1
echo "profile exit $?"; grep -v "Warning\|warn" $D/trainer_profile.log | sed -n '/family/,/total GPU/p'; grep "wall\|recompile" $D/trainer_profile.log | head
rm -rf /tmp/runs/profile/checkpoints; gzip -f $D/trainer_profile.trace.json
save
