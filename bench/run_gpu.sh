#!/bin/bash
# One device call for the GPU work: tests, benchmarks and profiles, picked by STEPS.
# Usage, from the repository root on the GPU machine:
#   OUT=/some/dir STEPS="tests kernels" bash bench/run_gpu.sh
# Each step logs to $OUT/<step>.log, prints the log's tail (TAIL lines, default 6; the kernel
# benchmark prints its whole table) and "== <step>: rc=N in S s". Results are written under
# their standard names, <benchmark>-<machine>.json, machine = h200 (one GPU) or h200xN (N GPUs;
# MACHINE overrides it): copy them over bench/results/ to publish a run.
#
# Steps (default: "tests kernels comm master comm_bench"):
#   tests         the whole -m gpu test suite -> gpu-tests-<machine>.log (GPU_TESTS, GPU_TESTS_TIMEOUT,
#                 default 300 s), after a prebuild (below): on a fresh machine the suite's
#                 workers otherwise each compile the quantize variants they meet, and a run cut
#                 at 330 s got through a quarter of the suite
#   kernel_tests  -m gpu tests/kernels/test_gpu.py only            (TEST_TIMEOUT)
#   kernels       bench.bench_kernels $BENCH_ARGS -> kernels-<machine>.json (BENCH_TIMEOUT);
#                 torchao 0.18 peers need its wheel carried in .whl/
#   prebuild      python3 -m fp8blk prebuild (compiled-kernel disk cache)
#   cold_start    bench.cold_start -> cold-start-<machine>.json
#   host          bench.bench_host (host cost per call from torch and CuPy) -> host-<machine>.json
#   linear_host   bench/profile/profile_linear_host.py: a Linear step's host time beside bf16's,
#                 where it goes, eager and compiled -> profile-linear-host{,-compiled}-<M>.txt;
#                 profile_host_threads.py: forward and backward apart, autograd's device thread
#                 and idle threads -> profile-host-threads-<M>.txt (bench/profile/results/)
#   ncu_fused     Nsight Compute profile of the fused quantize kernels -> ncu_fused.txt
#   profile       bench/profile/profile_all.sh: Nsight Compute over profile_fused.py,
#                 profile_master.py, profile_unaligned.py -> ncu_*.txt
#   comm          comm suites: NCCL 1 rank, CuPy over MPI 2 ranks, torch NCCL 1 rank, and
#                 NCCL on every GPU when there are several               (COMM_TIMEOUT)
#   master        bench.bench_master -> master-<machine>.json
#   comm_bench    bench.bench_comm, one rank per GPU -> comm-<machine>.json
#   bench         the same as "master comm_bench"
#   gather        bench.bench_gather under mpiexec, one rank per GPU -> gather-nccl-<machine>.json
#   gather_torch  bench.bench_gather --comm torch under torchrun -> gather-torch-<machine>.json
#   linear        bench.bench_linear -> linear-<machine>.json (LINEAR_ARGS: more flags; the run
#                 replaces its section: default, or --compile's, or --section S's)
#   model         bench.bench_model -> model-<machine>.json (MODEL_ARGS, MODEL_TIMEOUT)
#   model_profile bench/profile/profile_model_step.py: a model step's kernels by kind and name
#                 (PROFILE_ARGS, default the 1B widths compiled, bf16 beside fp8blk_opt)
#                 -> profile-model-step-<machine>.txt (bench/profile/results/)
#   moe           bench.bench_moe (grouped GEMMs, MoE blocks) -> moe-<machine>.json (MOE_ARGS,
#                 MOE_TIMEOUT)
#   norm          bench.bench_norm (RMSNorm: torch ops, compiled, fp8blk's kernels) -> norm-<machine>.json
#   loss_parity   bench.loss_parity -> loss-parity-<machine>.{json,png}, its --arch's section
#                 (LOSS_ARGS: "--arch qwen3_moe" for the MoE model; LOSS_TIMEOUT)
#   fsdp          bench.bench_fsdp under torchrun per token count in FSDP_TOKENS (default 8192)
#                 -> fsdp-<machine>.json, one section tokens<T> per count
#                 (FSDP_ARGS: more flags, e.g. "--profile 5": where the host time goes)
#   ep            bench.bench_ep under torchrun, one rank per GPU -> ep-<machine>.json, section
#                 tokens<T> (EP_ARGS: more flags; EP_TIMEOUT)
#   multirank     the comm suites with one rank per GPU: NCCLComm (mpiexec), TorchComm (torchrun)
#   tp            tp_parity.py on NCCL, one rank per GPU
#   examples      weights_pipeline / train_fsdp2 / tensor_parallel --large, one rank per GPU
# linear, fsdp and ep write sections of one file: $OUT's file starts as bench/results/' copy, so
# the sections a run does not redo carry over.
# PROFILE=1 adds ncu_fused. Open MPI on the GPU image is not CUDA-aware and needs the flags below.
set -o pipefail
OUT=${OUT:-/tmp/fp8blk-bench}  # step logs land here too: copy the results over bench/results/
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
export TORCHINDUCTOR_COMPILE_THREADS=16
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # torchao (and any other carried wheel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
NGPU=$(nvidia-smi -L | wc -l)
M=${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($NF)}')}
[ -z "$MACHINE" ] && [ "$NGPU" -gt 1 ] && M=${M}x$NGPU
MPIEXEC="/usr/bin/mpiexec --allow-run-as-root --oversubscribe"
PY=$(command -v python3)  # mpiexec's children would otherwise find /usr/bin/python3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
SCRIPTS_TORCH=tests/torch/scripts

step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, print its tail and status
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n ${TAIL:-6} "$OUT/$name.log"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
}
seed_result() {  # seed_result NAME: $OUT/NAME starts as bench/results/NAME (its sections)
  [ -f "$OUT/$1" ] || [ ! -f "bench/results/$1" ] || cp "bench/results/$1" "$OUT/$1"
}
name_result() {  # name_result GLOB NAME: the newest $OUT/GLOB becomes $OUT/NAME (bench_gather
  # names its file by date)
  local f=$(ls -t $OUT/$1 2>/dev/null | head -1)
  [ -n "$f" ] && [ "$f" != "$OUT/$2" ] && mv "$f" "$OUT/$2"
  return 0
}
STEPS=${STEPS:-tests kernels comm master comm_bench}
[ -n "$PROFILE" ] && STEPS="$STEPS ncu_fused"
has() { [[ " $STEPS " == *" $1 "* ]]; }
CT=${COMM_TIMEOUT:-300}  # a cold machine JIT-compiles every gather variant first

if has prebuild || has tests; then     # the disk cache the tests' workers then share
  step prebuild ${PREBUILD_TIMEOUT:-600} python3 -m fp8blk prebuild
fi
has tests && step gpu-tests-$M ${GPU_TESTS_TIMEOUT:-300} \
  python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 ${GPU_TESTS:-tests}
has kernel_tests && step gpu_kernel_tests ${TEST_TIMEOUT:-300} \
  python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/kernels/test_gpu.py
if has kernels; then
  TAIL=${KERNELS_TAIL:-80} step bench_kernels ${BENCH_TIMEOUT:-280} \
    python3 -m bench.bench_kernels --out "$OUT" $BENCH_ARGS
fi
has cold_start && step cold_start ${COLD_TIMEOUT:-300} \
  python3 -m bench.cold_start --out "$OUT/cold-start-$M.json"
has host && TAIL=30 step bench_host 200 python3 -m bench.bench_host --out "$OUT/host-$M.json"
if has linear_host; then
  TAIL=16 step linear_host ${HOST_TIMEOUT:-300} \
    python3 -m bench.profile.profile_linear_host --out "$OUT/profile-linear-host-$M.txt"
  TAIL=8 step linear_host_compiled ${HOST_TIMEOUT:-300} python3 -m \
    bench.profile.profile_linear_host --compiled --out "$OUT/profile-linear-host-compiled-$M.txt"
  TAIL=60 step host_threads ${HOST_TIMEOUT:-300} \
    python3 -m bench.profile.profile_host_threads --out "$OUT/profile-host-threads-$M.txt"
fi
has model_profile && TAIL=80 step model_profile ${PROFILE_TIMEOUT:-400} \
  python3 -m bench.profile.profile_model_step ${PROFILE_ARGS:---arch llama_1b --modes compiled} \
  --out "$OUT/profile-model-step-$M.txt"
if has ncu_fused && command -v ncu >/dev/null; then
  TAIL=60 step ncu_fused 150 ncu --clock-control none --kernel-name regex:^kernel \
    --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats python3 -m bench.profile.profile_fused
fi
has profile && step profile 700 bash bench/profile/profile_all.sh
if has comm; then
  step comm_nccl_1 $CT $MPIEXEC -n 1 $PY -m mpi4py tests/comm/scripts/comm_suite.py nccl
  step comm_mpi_cupy_2 $CT $MPIEXEC -n 2 $PY -m mpi4py tests/comm/scripts/comm_suite.py mpi-cupy
  step comm_torch_nccl_1 ${TORCH_TIMEOUT:-90} torchrun --standalone --nproc-per-node 1 \
    tests/comm/scripts/torch_suite.py nccl
  if [ "$NGPU" -gt 1 ]; then
    step comm_nccl_$NGPU $CT $MPIEXEC -n $NGPU $PY -m mpi4py tests/comm/scripts/comm_suite.py nccl
  fi
fi
if has master || has bench; then
  step bench_master 200 python3 -m bench.bench_master --out "$OUT/master-$M.json"
fi
if has comm_bench || has bench; then
  step bench_comm_$NGPU 120 $MPIEXEC -n $NGPU $PY -m mpi4py -m bench.bench_comm --out "$OUT"
fi
if has gather; then
  step bench_gather_$NGPU ${GATHER_TIMEOUT:-300} $MPIEXEC -n $NGPU $PY -m mpi4py \
    -m bench.bench_gather --out "$OUT" $GATHER_ARGS
  name_result "gather-nccl-h200x*-20??-??-??.json" gather-nccl-$M.json
fi
if has gather_torch; then
  step bench_gather_torch_$NGPU ${GATHER_TIMEOUT:-300} torchrun --standalone --nproc-per-node $NGPU \
    -m bench.bench_gather --comm torch --out "$OUT" $GATHER_ARGS
  name_result "gather-torch-h200x*-20??-??-??.json" gather-torch-$M.json
fi
if has multirank; then  # the N-rank comm suites on NCCL: NCCLComm and TorchComm, one GPU per rank
  step comm_nccl_$NGPU ${MULTIRANK_TIMEOUT:-200} $MPIEXEC -n $NGPU $PY -m mpi4py \
    tests/comm/scripts/comm_suite.py nccl
  step comm_torch_nccl_$NGPU ${MULTIRANK_TIMEOUT:-200} torchrun --standalone \
    --nproc-per-node $NGPU tests/comm/scripts/torch_suite.py nccl
fi
if has tp; then  # tensor / sequence parallelism parity, one GPU per rank, NCCL
  FP8BLK_TP_DEVICE=cuda step tp_parity_$NGPU ${TP_TIMEOUT:-200} torchrun --standalone \
    --nproc-per-node $NGPU $SCRIPTS_TORCH/tp_parity.py 1 tp tp_nobias sp_fast sp_fallback
fi
if has examples; then  # the examples at their GPU sizes, one rank per GPU
  step ex_weights_$NGPU ${EX_TIMEOUT:-200} $MPIEXEC -n $NGPU -x PYTHONPATH -x NCCL_NVLS_ENABLE \
    $PY -m mpi4py examples/weights_pipeline.py --large
  step ex_fsdp2_$NGPU ${EX_TIMEOUT:-200} torchrun --standalone --nproc-per-node $NGPU \
    examples/train_fsdp2.py --large $FSDP2_EX_ARGS
  step ex_tp_$NGPU ${EX_TIMEOUT:-200} torchrun --standalone --nproc-per-node $NGPU \
    examples/tensor_parallel.py --large
fi
if has linear; then
  seed_result linear-$M.json
  step bench_linear ${LINEAR_TIMEOUT:-300} \
    python3 -m bench.bench_linear --out "$OUT/linear-$M.json" $LINEAR_ARGS
fi
has model && step bench_model ${MODEL_TIMEOUT:-600} \
  python3 -m bench.bench_model --out "$OUT/model-$M.json" $MODEL_ARGS
has moe && step bench_moe ${MOE_TIMEOUT:-400} \
  python3 -m bench.bench_moe --out "$OUT/moe-$M.json" $MOE_ARGS
has norm && step bench_norm ${NORM_TIMEOUT:-180} python3 -m bench.bench_norm --out "$OUT"
has loss_parity && seed_result "loss-parity-$M.json" && step loss_parity ${LOSS_TIMEOUT:-600} \
  python3 -m bench.loss_parity --out "$OUT/loss-parity-$M.json" --plot "$OUT/loss-parity-$M.png" \
  ${LOSS_ARGS:-}
if has fsdp; then
  seed_result fsdp-$M.json
  for tokens in ${FSDP_TOKENS:-8192}; do
    step bench_fsdp_${NGPU}_$tokens ${FSDP_TIMEOUT:-300} torchrun --standalone \
      --nproc-per-node $NGPU -m bench.bench_fsdp --tokens $tokens --out "$OUT/fsdp-$M.json" \
      $FSDP_ARGS
  done
fi
if has ep; then
  seed_result ep-$M.json
  TAIL=${EP_TAIL:-45} step bench_ep_$NGPU ${EP_TIMEOUT:-600} torchrun --standalone \
    --nproc-per-node $NGPU -m bench.bench_ep --out "$OUT/ep-$M.json" $EP_ARGS
fi
if [ -n "$TARBALL" ]; then  # the device tool returns at most 8 files: logs in one tarball
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log *.txt 2>/dev/null))
fi
exit 0
