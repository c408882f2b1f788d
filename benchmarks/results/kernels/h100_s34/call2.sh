#!/usr/bin/env bash
# Session 34, call 2: Nsight Compute on the Mamba-3 kernels of one fwd+bwd at the bench's shape
# (B 8, L 4096, 32 heads of d_state 128, bf16), the tree's kernels (session 32's).
#   usage: bash benchmarks/results/kernels/h100_s34/call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
D=$OUT/call2; mkdir -p $D
which ncu || ls /usr/local/cuda*/bin/ncu
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
KERNELS='regex:^_(prep|state_fwd|out_fwd|state_bwd|bwd_dx|bwd_dqk|bwd_tokens|group_sum)$'
timeout 500 $NCU --clock-control none -k "$KERNELS" -c 8 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
  --export $D/mamba3_bench python3 benchmarks/results/kernels/h100_s34/mamba3_once.py \
  > $D/ncu_run.log 2>&1
echo "ncu exit $?"; tail -3 $D/ncu_run.log
$NCU --import $D/mamba3_bench.ncu-rep --page details > $D/ncu_details.txt 2>&1
$NCU --import $D/mamba3_bench.ncu-rep --page raw --csv --metrics \
gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu.sum,lts__t_bytes.sum \
  > $D/ncu_metrics.csv 2>&1
ls -la $D; grep -E "^  [a-z_]+|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Stall" $D/ncu_details.txt | head -120
