#!/bin/bash
# Nsight Compute profiles of the heavy kernels (fused row+col quantize, master-weight
# partial kernels, unaligned transposed outputs and dequantize). Usage on the device:
#   OUT=$OUT bash bench/profile/profile_all.sh
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
for s in fused master unaligned; do
  timeout ${NCU_TIMEOUT:-200} ncu --clock-control none --kernel-name regex:kernel $SECTIONS \
    python3 -m bench.profile.profile_$s > "$OUT/ncu_$s.txt" 2>&1
  echo "ncu $s: rc=$?"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Local Memory|Issue Slots Busy|Warp Cycles Per Issued|No Eligible" "$OUT/ncu_$s.txt" | head -150
done
