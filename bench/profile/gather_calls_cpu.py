"""Python calls per steady-state quantized gather, on the CPU: ``sizes=`` and
``out=`` given, the same ``out`` every call. Two set-ups:

    mpiexec -n 2 python3 -m mpi4py -m bench.profile.gather_calls_cpu mpi [--calls 200] [--cprofile F]
    python3 -m bench.profile.gather_calls_cpu device [--ranks 2]

``mpi``: MPIComm on NumPy arrays (the host path). ``device``: the device path without a GPU:
NCCLComm on thread ranks, NCCL a stand-in on host memory and NumPy arrays taken for device
arrays (tests/comm/fake_ranks.py), so the gather runs its device code (current-stream handle,
the fix-up's runtime calls) with host stand-ins for CUDA.

Per case, rank 0 prints the Python function calls ("call" events of ``sys.setprofile``) and C
calls ("c_call") per gather call, split by where they happen: ``quantize`` (the local
quantize, ``quantize_into``: on the GPU one kernel launch, here the NumPy reference),
``collective`` (the backend's issue of the grouped gather, without the stand-in NCCL's own
calls, counted as ``nccl``), ``fixup_rt`` (the stand-in runtime's copies: C calls on the GPU)
and ``gather`` (everything else: argument and plan checks, views, the fix-up's replay). Also
wall microseconds per call (``mpi``). ``--cprofile F``: top functions of the Block1D rowwise
case by own time, to F.r<rank>.
"""
import argparse
import sys
import time

import ml_dtypes
import numpy as np

import fp8blk as fb

CASES = (("b1d_row", fb.Block1D(), True, False), ("b1d_rowcol", fb.Block1D(), True, True),
         ("mxfp8_row", fb.MXFP8(), True, False))
REGIONS = {"quantize_into": "quantize", "gather_parts": "collective", "issue": "collective",
           "allGather": "nccl", "broadcast": "nccl", "memcpy2DAsync": "fixup_rt",
           "memsetAsync": "fixup_rt"}


class Counter:
    """Python calls ("call") and C calls ("c_call") per region: a call of a REGIONS function
    opens its region for everything below it (the innermost region counts)."""

    def __init__(self):
        self.counts, self.stack = {}, []

    def __call__(self, frame, event, arg):
        here = self.stack[-1] if self.stack else "gather"
        if event == "call":
            here = REGIONS.get(frame.f_code.co_name, here)
            self.stack.append(here)
        elif event == "return":
            if self.stack:
                self.stack.pop()
            return
        elif event != "c_call":
            return
        self.counts[(here, event)] = self.counts.get((here, event), 0) + 1

    def per_call(self, calls):
        return {f"{region}_{event}": round(n / calls, 1)
                for (region, event), n in sorted(self.counts.items())}


def run_cases(comm, x, calls, barrier, cprofile=None):
    """Count the steady-state calls of every case on this rank; rank 0 prints them."""
    sizes = [x.shape[0]] * comm.size
    for name, recipe, rowwise, columnwise in CASES:
        out, _ = fb.comm.gather_along_first_dim(x, comm, recipe, rowwise, columnwise,
                                                sizes=sizes)

        def call():
            fb.comm.gather_along_first_dim(x, comm, recipe, rowwise, columnwise, sizes=sizes,
                                           out=out)
        for _ in range(5):
            call()
        counter = Counter()
        barrier()
        if comm.rank == 0:
            sys.setprofile(counter)
        for _ in range(calls):
            call()
        sys.setprofile(None)
        barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        us = (time.perf_counter() - t0) * 1e6 / calls
        if cprofile and name == "b1d_row":
            _cprofile(call, calls, f"{cprofile}.r{comm.rank}")
        if comm.rank == 0:
            print(name, f"{us:.0f} us/call", counter.per_call(calls), flush=True)


def _cprofile(call, calls, path):
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    with open(path, "w") as handle:
        stats = pstats.Stats(prof, stream=handle)
        handle.write(f"{stats.total_calls / calls:.1f} calls per gather\n")
        stats.sort_stats("tottime").print_stats(40)


def mpi_main(args):
    from mpi4py import MPI

    comm = fb.comm.MPIComm(MPI.COMM_WORLD)
    x = np.random.default_rng(comm.rank).standard_normal((args.rows, args.k))
    run_cases(comm, x.astype(ml_dtypes.bfloat16), args.calls, comm.mpi_comm.Barrier,
              args.cprofile)


def device_main(args):
    from fp8blk.comm.gather import paths
    from tests.comm.fake_ranks import DeviceOps, FakeNccl, World, host_nccl, run_ranks

    host_nccl(setattr)
    ops = DeviceOps()
    paths.result_ops = lambda src: ops  # every rank's arrays "on the device"
    gate = World(args.ranks)

    def body(comm):
        x = np.random.default_rng(comm.rank).standard_normal((args.rows, args.k))
        run_cases(comm, x.astype(np.float32), args.calls,
                  lambda: gate.exchange(comm.rank, None))
    run_ranks(args.ranks, body, FakeNccl)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("setup", choices=("mpi", "device"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=2, help="device: thread ranks")
    parser.add_argument("--cprofile", default=None)
    args = parser.parse_args()
    (mpi_main if args.setup == "mpi" else device_main)(args)


if __name__ == "__main__":
    main()
