#!/usr/bin/env bash
# Session 33: groups FIRST..LAST of the GPU suite in 4 groups (scripts/gpu_tests.sh), one after
# another while BUDGET_S seconds are left; logs and the measured durations under $OUT/gpu_tests.
#   usage: bash benchmarks/results/kernels/h100_s33/gpu_tests_call.sh FIRST LAST BUDGET_S
#   (on the GPU machine, carrying .whl: the peers' wheels and pytest-split's)
set -u
first=$1 last=$2 budget=$3
start=$(date +%s)
D=$OUT/gpu_tests; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$D/device_$first-$last.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$D/device_$first-$last.txt"
for g in $(seq "$first" "$last"); do
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then echo "group $g: not started ($left s left)"; break; fi
  GPU_DURATIONS_OUT=$D/measured.json timeout -s INT "$left" \
    bash scripts/gpu_tests.sh "$g" 4 -vv --durations=10 > "$D/group$g.log" 2>&1
  echo "group $g exit $? after $(( $(date +%s) - start )) s"; tail -3 "$D/group$g.log"
done
