#!/bin/bash
# One device call for everything outside the kernel benchmark: the whole -m gpu test suite,
# the comm suites with NCCL and with CuPy staged through MPI, the master-weight benchmark, and
# the multi-GPU comm benchmark with one rank per GPU. Usage, from the repo root:
#   OUT=/some/dir bash bench/run_gpu_all.sh
# STEPS (default "tests comm bench") picks parts; COMM_TIMEOUT (default 300 s) limits each comm
# suite: a cold machine JIT-compiles every gather variant first. Logs and JSON go to $OUT. Open MPI on the GPU image is not CUDA-aware and needs the flags.
set -o pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L | wc -l)
MPIEXEC="/usr/bin/mpiexec --allow-run-as-root --oversubscribe"
PY=$(command -v python3)  # mpiexec's children would otherwise find /usr/bin/python3
nvidia-smi -L
step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, print its tail and status
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n ${TAIL:-6} "$OUT/$name.log"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
}
STEPS=${STEPS:-tests comm bench}
has() { [[ " $STEPS " == *" $1 "* ]]; }
CT=${COMM_TIMEOUT:-300}
has tests && step gpu_tests ${GPU_TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 ${GPU_TESTS:-tests}
if has comm; then
step comm_nccl_1 $CT $MPIEXEC -n 1 $PY -m mpi4py tests/comm/mpi_scripts/comm_suite.py nccl
step comm_mpi_cupy_2 $CT $MPIEXEC -n 2 $PY -m mpi4py tests/comm/mpi_scripts/comm_suite.py mpi-cupy
step comm_torch_nccl_1 ${TORCH_TIMEOUT:-90} torchrun --standalone --nproc-per-node 1 tests/comm/mpi_scripts/torch_suite.py nccl
if [ "$NGPU" -gt 1 ]; then
  step comm_nccl_$NGPU $CT $MPIEXEC -n $NGPU $PY -m mpi4py tests/comm/mpi_scripts/comm_suite.py nccl
fi
fi
has bench && step bench_master 200 python3 bench/bench_master.py --out "$OUT/master-h200-$(date +%F).json"
has bench && step bench_comm_$NGPU 120 $MPIEXEC -n $NGPU $PY -m mpi4py bench/bench_comm.py --out "$OUT"
