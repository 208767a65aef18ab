#!/bin/bash
# One device call: GPU tests, then the benchmark. Usage (from the repo root, on the H200):
#   bash bench/run_h200.sh [bench args...]
# Writes logs and bench JSON under $OUT (default bench/results). Carry .whl (torchao 0.18.0).
set -o pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 TORCHINDUCTOR_COMPILE_THREADS=16
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/kernels/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "gpu tests: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-280} python3 bench/bench_kernels.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/bench.log"
echo "bench: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"
if [ -n "$PROFILE" ] && command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none --kernel-name regex:^kernel --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 bench/profile_fused.py > "$OUT/ncu_fused.txt" 2>&1
  echo "ncu: rc=$?"; grep -E "kernel\[|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Memory Throughput|Compute \(SM\)" "$OUT/ncu_fused.txt" | head -60
fi
