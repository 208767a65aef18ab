"""Quantized all-gather vs a bf16 all-gather vs raw NCCL. One rank per GPU:

    mpiexec --allow-run-as-root --oversubscribe -n 2 python3 -m mpi4py bench/bench_gather.py \
        --out bench/results                                   # NCCLComm (+ raw cupy NCCL)
    torchrun --standalone --nproc-per-node 2 bench/bench_gather.py --comm torch \
        --out bench/results                                   # TorchComm on torch's NCCL

A (rows, 4096) bf16 shard per rank at 1, 16, 64 and 256 MiB (``--mib``). Cases per size:

``raw_nccl``       cupy.cuda.nccl allGather of the bf16 bytes (NCCLComm only)
``all_gather``     ``comm.all_gather(shard, out)`` (the public collective)
``bf16``           ``gather_along_first_dim(x, comm, sizes=..., out=...)`` (plain path)
``b1d_row``        Block1D rowwise, ``sizes=`` and ``out=`` (steady state: no metadata)
``b1d_row_check``  the same without ``sizes=`` (one 16-byte host check per call)
``b1d_rowcol``     Block1D rowwise + columnwise (fast path: shards are multiples of 128 rows)
``mxfp8_row``      MXFP8 rowwise

Figures per case (the slowest rank's median): ``gpu_us`` per call from CUDA events around
back-to-back calls; ``host_us`` per call (wall time of enqueueing the calls, no sync inside);
``speedup_vs_bf16`` = bf16 gpu_us / case gpu_us; bytes sent per rank. Quantized cases also get
a breakdown: ``quantize_gpu_us`` (the local quantize kernel alone), ``collective_gpu_us`` (raw
NCCL of the same byte counts in one group), ``fixup_gpu_us`` (the scale/layout step alone),
and host microseconds of each step (plan lookup, the steady state's match instead of it,
quantize, collective issue, fix-up). Every
quantized case is checked byte for byte against ``quantize`` of the gathered bf16 tensor.
Rank 0 prints one JSON line per case and writes ``OUT/gather-<comm>-h200x<N>-<date>.json``.

TorchComm packs a gather's parts into one torch collective up to ``--coalesce-mib`` MiB per
rank (default ``TorchComm.coalesce_limit``; 0: one collective per part, in place): run it
with 0 and with a large value to see where packing stops paying.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import cupy
import numpy as np
import torch

import fp8blk as fb
from fp8blk.comm import gather
from fp8blk.comm.gather import paths, status, streams
from fp8blk.comm.gather.plan import STAGED
from fp8blk.layout import all_layouts
from fp8blk.ops import quantize_into

K = 4096


class World:
    """Host-side helpers over MPI or torch.distributed (barrier, max over ranks)."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "nccl":
            from mpi4py import MPI

            self.MPI = MPI
            self.mpi = MPI.COMM_WORLD
            self.comm = fb.comm.NCCLComm.from_mpi(self.mpi)
            torch.cuda.set_device(self.comm.device)
        else:
            import torch.distributed as dist

            self.dist = dist
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            cupy.cuda.Device(local).use()
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            self.comm = fb.comm.TorchComm()
        self.rank, self.size = self.comm.rank, self.comm.size

    def barrier(self):
        torch.cuda.synchronize()
        if self.kind == "nccl":
            self.mpi.Barrier()
        else:
            self.dist.barrier()

    def max(self, value):
        if self.kind == "nccl":
            return self.mpi.allreduce(float(value), op=self.MPI.MAX)
        t = torch.tensor([float(value)], device="cuda")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def all_true(self, flag):
        return self.max(0.0 if flag else 1.0) == 0.0


def measure(world, fn, repeats=7, inner=10):
    """(gpu_us, host_us) per call: median over repeats of `inner` back-to-back calls; the
    slowest rank's figure. Host time is the enqueue time of the calls (no sync inside)."""
    stream = torch.cuda.current_stream()
    for _ in range(3):
        fn()
    world.barrier()
    gpu, host = [], []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        t1 = time.perf_counter()
        stop.record(stream)
        stop.synchronize()
        gpu.append(start.elapsed_time(stop) * 1e3 / inner)
        host.append((t1 - t0) * 1e6 / inner)
        world.barrier()
    return world.max(statistics.median(gpu)), world.max(statistics.median(host))


def host_only(world, fn, calls=200):
    """Host microseconds per call of a step that enqueues device work, synchronized every
    20 calls so the queue never fills."""
    world.barrier()
    samples = []
    for _ in range(calls // 20):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / 20)
        torch.cuda.synchronize()
    return world.max(statistics.median(samples))


def profile(world, fn, calls, path):
    """cProfile of `calls` back-to-back calls (synchronized every 10, like measure); the
    top functions by own time and by cumulative time go to `path`."""
    import cProfile
    import io
    import pstats

    world.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 10 == 9:
            torch.cuda.synchronize()
    prof.disable()
    world.barrier()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text.getvalue())


def equal_bytes(a, b):
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def breakdown(world, x, recipe, rowwise, columnwise, sizes, out):
    """GPU and host time of each step of one steady-state quantized gather."""
    from cupy.cuda import nccl

    comm = world.comm
    src, plan, _, _ = gather.resolve(comm, x, recipe, rowwise, columnwise, sizes)
    ops = paths.result_ops(src)  # torch ops for torch input (no DLPack)
    targets = paths.targets_for(plan, out, ops)
    layouts = all_layouts(recipe, plan.local_rows(), plan.K)
    quantized = [i for i in range(4) if (i < 2 and rowwise) or (i >= 2 and (
        columnwise and not isinstance(recipe, fb.Block2D)))]
    local = [ops.empty(layouts[i].shape, layouts[i].dtype) if i in quantized else None
             for i in range(4)]
    x2d = streams.local_x2d(src.x, src.m, src.k, plan.local_rows())
    row, col = rowwise, columnwise and not isinstance(recipe, fb.Block2D)
    result = {}
    q = lambda: quantize_into(x2d, recipe, row, col, src.dtype, local)  # noqa: E731
    result["quantize_gpu_us"], _ = measure(world, q)
    result["quantize_host_us"] = host_only(world, q)
    result["plan_host_us"] = host_only(
        world, lambda: gather.resolve(comm, x, recipe, rowwise, columnwise, sizes))
    # the steady state's match against the last call into out (instead of the plan lookup)
    result["lane_host_us"] = host_only(world, lambda: paths.steady_lane(
        comm, x, recipe, rowwise, columnwise, sizes, out, False, None))
    stagings = {p.index: ops.empty(sum(p.counts), np.uint8) for p in plan.parts
                if p.mode == STAGED}
    # the fix-up as the steady state replays it (built once: device calls on this stream)
    fix = status.fix_up_post(plan, targets, stagings, ops, ops.current_stream_ptr())
    result["fixup_gpu_us"], _ = measure(world, fix)
    result["fixup_host_us"] = host_only(world, fix)
    if world.kind == "nccl":
        bufs = [cupy.empty(sum(p.counts), cupy.uint8) for p in plan.parts]

        def raw():
            stream = cupy.cuda.get_current_stream().ptr
            nccl.groupStart()
            for p, buf in zip(plan.parts, bufs):
                mine = p.counts[plan.rank]
                if mine:
                    comm.nccl_comm.allGather(buf.data.ptr + p.displs[plan.rank], buf.data.ptr,
                                             mine, nccl.NCCL_UINT8, stream)
            nccl.groupEnd()
        result["collective_gpu_us"], result["collective_host_us"] = measure(world, raw)
    items = [(None, ops.empty(sum(p.counts), np.uint8), p.counts) for p in plan.parts]
    issuer, stream_ptr = comm.gather_parts_issuer(items), ops.current_stream_ptr()

    def issue():  # as the steady state issues it (arguments worked out once)
        finish = issuer(stream_ptr)
        if finish is not None:  # torch NCCL: only makes the current stream wait
            finish()
    result["issue_host_us"] = host_only(world, issue)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--comm", choices=("nccl", "torch"), default="nccl")
    parser.add_argument("--mib", default="1,16,64,256")
    parser.add_argument("--out", default=".")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--coalesce-mib", type=float, default=None,
                        help="TorchComm only: pack a gather's parts into one collective up "
                             "to this many MiB per rank (default: TorchComm.coalesce_limit)")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also run CALLS back-to-back calls of each case under cProfile on "
                             "every rank; OUT/gather-profile-<comm>-<case>-<mib>mib-r<rank>.txt")
    args = parser.parse_args()
    world = World(args.comm)
    comm, n, me = world.comm, world.size, world.rank
    if world.kind == "torch" and args.coalesce_mib is not None:
        comm.coalesce_limit = int(args.coalesce_mib * 2**20)
    results = []

    def emit(row):
        results.append(row)
        if me == 0:
            print(json.dumps(row), flush=True)

    for mib in [int(v) for v in args.mib.split(",")]:
        rows = mib * 2**20 // (2 * K)
        sizes = [rows] * n
        gen = torch.Generator(device="cuda").manual_seed(1000 + me)
        # rows spanning orders of magnitude: every block gets its own scale
        x = (torch.randn(rows, K, device="cuda", generator=gen)
             * torch.logspace(-3, 3, rows, device="cuda")[:, None]).to(torch.bfloat16)
        full = torch.empty(n * rows, K, device="cuda", dtype=torch.bfloat16)
        base = {"mib_per_rank": mib, "rows_per_rank": rows, "K": K}
        if world.kind == "torch":
            base["coalesce_limit"] = comm.coalesce_limit
        if world.kind == "nccl":
            from cupy.cuda import nccl

            send, recv = x.view(torch.uint8).reshape(-1), full.view(torch.uint8).reshape(-1)

            def raw():
                comm.nccl_comm.allGather(send.data_ptr(), recv.data_ptr(), send.numel(),
                                         nccl.NCCL_UINT8, cupy.cuda.get_current_stream().ptr)
            gpu, host = measure(world, raw)
            emit(dict(base, case="raw_nccl", gpu_us=gpu, host_us=host,
                      bytes_per_rank=send.numel()))
        gpu, host = measure(world, lambda: comm.all_gather(x, out=full))
        emit(dict(base, case="all_gather", gpu_us=gpu, host_us=host,
                  bytes_per_rank=x.numel() * 2))
        fb.comm.gather_along_first_dim(x, comm, sizes=sizes, out=full)
        bf16_gpu, host = measure(world, lambda: fb.comm.gather_along_first_dim(
            x, comm, sizes=sizes, out=full))
        emit(dict(base, case="bf16", gpu_us=bf16_gpu, host_us=host,
                  bytes_per_rank=x.numel() * 2))
        gathered = full.clone()
        cases = [("b1d_row", fb.Block1D(), True, False, sizes),
                 ("b1d_row_check", fb.Block1D(), True, False, None),
                 ("b1d_rowcol", fb.Block1D(), True, True, sizes),
                 ("mxfp8_row", fb.MXFP8(), True, False, sizes)]
        for name, recipe, rowwise, columnwise, case_sizes in cases:
            try:
                comm.reset_stats()
                out, _ = fb.comm.gather_along_first_dim(x, comm, recipe, rowwise, columnwise,
                                                        sizes=case_sizes)
                sent, path = comm.stats.bytes, comm.stats.last_gather_path
                expected = fb.quantize(gathered, recipe, rowwise, columnwise)
                exact = all(equal_bytes(getattr(out, a), getattr(expected, a)) for a in (
                    "rowwise_data", "rowwise_scale_inv", "columnwise_data",
                    "columnwise_scale_inv"))
                exact = world.all_true(exact)
                call = lambda: fb.comm.gather_along_first_dim(  # noqa: E731
                    x, comm, recipe, rowwise, columnwise, sizes=case_sizes, out=out)
                gpu, host = measure(world, call)
                if args.profile:
                    profile(world, call, args.profile, os.path.join(
                        args.out, f"gather-profile-{args.comm}-{name}-{mib}mib-r{me}.txt"))
                comm.reset_stats()
                call()
                row = dict(base, case=name, path=path, exact=exact, gpu_us=gpu, host_us=host,
                           bytes_per_rank=sent, meta_calls_per_call=comm.stats.meta_calls,
                           speedup_vs_bf16=bf16_gpu / gpu)
                if not args.no_breakdown and case_sizes is not None:
                    row.update(breakdown(world, x, recipe, rowwise, columnwise, case_sizes,
                                         out))
                emit(row)
            except Exception as exc:  # keep the other cases; report the failure
                emit(dict(base, case=name, error=f"{type(exc).__name__}: {exc}"))
                if me == 0:
                    import traceback

                    traceback.print_exc()
        x = full = gathered = None  # free before the next size
        torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()

    if me == 0:
        from cupy.cuda import nccl as cupy_nccl  # not a cupy.cuda attribute until imported

        name = torch.cuda.get_device_name(0)
        record = {"machine": f"{n}x {name}", "date": datetime.datetime.now(
                      datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                  "comm": args.comm, "ranks": n, "host": platform.node(),
                  "versions": {"torch": torch.__version__, "cupy": cupy.__version__,
                               "nccl": cupy_nccl.get_version()},
                  "results": results}
        os.makedirs(args.out, exist_ok=True)
        tag = "" if args.coalesce_mib is None else f"-coalesce{args.coalesce_mib:g}"
        path = os.path.join(args.out, f"gather-{args.comm}{tag}-h200x{n}-"
                                      f"{datetime.date.today().isoformat()}.json")
        with open(path, "w") as handle:
            json.dump(record, handle, indent=1)
        print(f"wrote {path}", flush=True)
    if world.kind == "torch":
        world.dist.destroy_process_group()


if __name__ == "__main__":
    main()
