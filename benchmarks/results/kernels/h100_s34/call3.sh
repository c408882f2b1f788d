#!/usr/bin/env bash
# Session 34, call 3: Nsight Compute on every kernel of one Mamba-3 SISO fwd+bwd at the bench's
# shape, mamba_ssm's (the peer) and ours, torch's own kernels included (the script's profiler
# range: the second fwd+bwd), carrying .whl (the mamba_ssm wheel).
#   usage: bash benchmarks/results/kernels/h100_s34/call3.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD:/tmp/site
D=$OUT/call3; mkdir -p $D
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
for who in peer ours; do
  timeout 280 $NCU --clock-control none --profile-from-start off \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
    --export $D/$who python3 benchmarks/results/kernels/h100_s34/mamba3_once.py $who \
    > $D/ncu_run_$who.log 2>&1
  echo "$who: ncu exit $?"; tail -2 $D/ncu_run_$who.log
  $NCU --import $D/$who.ncu-rep --page details > $D/ncu_details_$who.txt 2>&1
done
ls -la $D
