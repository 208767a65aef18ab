"""Host time per ``cast_master_weights`` call through the public API only, so that two versions
of fp8blk can be compared on the same workload (target: the rank agreement and validation add
at most 5% to the steady state's host time).

    PYTHONPATH=<tree A> python bench/profile/master_host_ab.py --label A   # world size 1
    PYTHONPATH=<tree B> python bench/profile/master_host_ab.py --label B
    mpiexec -n 2 python -m mpi4py bench/profile/master_host_ab.py --comm nccl  # a GPU per rank

It runs as a file, not a module, so that ``PYTHONPATH`` alone decides which fp8blk it imports.
Last results: ``bench/profile/results/master-host-ab-h200.json`` (one GPU) and
``master-host-ab-h200x2.json`` (two), against tree bb987c3^ (no rank agreement): host time
per call 0.98x / 1.00x of it for 4 / 100 weights on one GPU (minimum samples 170.6 / 1044.9
us); on two ranks 326 / 1696 us against 271 / 1281, on a noisy host.

The workload is bench/bench_master.py's batch: 4 and 100 weights (Block2D with and without
columnwise, MXFP8 bidirectional and row-only, in turn; shapes drawn with seed 7), fp32 master
shards on the GPU. With one rank it owns every weight whole (a local identity all-reduce);
with N ranks rank r owns the r-th of N equal element ranges of every weight (NCCLComm).
Per batch size: the median over 7 (``--repeats``) samples of the host time of 20 back-to-back
calls (the stream is synchronized between samples), per call; the minimum sample; the median
thread CPU time per call (what the host spent computing, less sensitive to a noisy machine
than wall time); and the number of function calls (Python and C) one call makes, which the
machine's noise cannot move. Prints one JSON line per batch size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import fp8blk as fb
from fp8blk import master
from fp8blk.layout import buffer_layouts

BATCH_DIMS = ([1024, 2048, 4096], [1024, 2048, 3072])


class LocalComm:
    rank, size = 0, 1

    def all_reduce(self, buf, op="max"):
        pass


def weight(cp, recipe, rowwise, columnwise, h, w):
    bufs = [None if layout is None else cp.empty(layout.shape, layout.dtype)
            for layout in buffer_layouts(recipe, h, w, rowwise, columnwise)]
    try:
        return fb.BlockTensor((h, w), recipe, *bufs, dtype=np.float32, family="cupy")
    except TypeError:  # an older constructor
        return fb.BlockTensor((h, w), recipe, *bufs)


def python_calls(call):
    """Function calls (Python and C) one call makes: a count the host's noise cannot move."""
    counts = {"call": 0, "c_call": 0}

    def count(frame, event, arg):
        if event in counts:
            counts[event] += 1
    sys.setprofile(count)
    try:
        call()
    finally:
        sys.setprofile(None)
    return counts["call"] + counts["c_call"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--comm", choices=("local", "nccl"), default="local")
    ap.add_argument("--repeats", type=int, default=7, help="samples of 20 calls per batch size")
    ap.add_argument("--profile", action="store_true",
                    help="also print a cProfile (by own time) of 200 calls per batch size")
    args = ap.parse_args()
    import cupy as cp

    if args.comm == "nccl":
        from mpi4py import MPI

        cp.cuda.Device(MPI.COMM_WORLD.Get_rank() % cp.cuda.runtime.getDeviceCount()).use()
        comm = fb.comm.NCCLComm.from_mpi(MPI.COMM_WORLD)
    else:
        comm = LocalComm()
    rank, size = comm.rank, comm.size
    rng = np.random.default_rng(7)
    recipes = [(fb.Block2D(fb.E4M3, True), True, False), (fb.MXFP8(fb.E4M3), True, True),
               (fb.MXFP8(fb.E4M3), True, False), (fb.Block2D(fb.E4M3, False), True, True)]
    for n_weights in (4, 100):
        shapes = [(int(rng.choice(BATCH_DIMS[0])), int(rng.choice(BATCH_DIMS[1])))
                  for _ in range(n_weights)]
        weights = [weight(cp, *recipes[i % 4], h, w) for i, (h, w) in enumerate(shapes)]
        masters, starts = [], []
        for h, w in shapes:
            part = h * w // size
            starts.append(rank * part)
            n = part if rank < size - 1 else h * w - rank * part
            masters.append(cp.random.default_rng(5).standard_normal(n, dtype=np.float32) * 3)

        def call():
            master.cast_master_weights(weights, masters, starts, comm)
        for _ in range(3):
            call()
        cp.cuda.get_current_stream().synchronize()
        samples, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(20):
                call()
            c1, t1 = time.thread_time(), time.perf_counter()
            samples.append((t1 - t0) / 20 * 1e6)
            cpu.append((c1 - c0) / 20 * 1e6)
            cp.cuda.get_current_stream().synchronize()
        calls = python_calls(call)
        if args.profile and rank == 0:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call()
            prof.disable()
            cp.cuda.get_current_stream().synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if rank == 0:
            print(json.dumps({"label": args.label, "ranks": size, "weights": n_weights,
                              "host_us_per_call": round(statistics.median(samples), 1),
                              "host_min_us": round(min(samples), 1),
                              "cpu_us_per_call": round(statistics.median(cpu), 1),
                              "python_calls_per_call": calls,
                              "samples_us": [round(s, 1) for s in samples]}), flush=True)


if __name__ == "__main__":
    main()
