"""Multi-GPU benchmark of fp8blk.comm and cast_master_weights. One rank per GPU:

    /usr/bin/mpiexec --allow-run-as-root --oversubscribe -n N \
        python3 -m mpi4py -m bench.bench_comm --out DIR

Measures, with CUDA events around back-to-back calls (median of several repetitions):
1. all_gather bus bandwidth of NCCLComm against a raw ``cupy.cuda.nccl`` allGather of the same
   bytes (busbw = output bytes / time * (N-1)/N, the nccl-tests convention);
2. a quantized Block1D gather (``gather_along_first_dim``) against a bf16 gather of the same
   bf16 tensor (64 MiB per rank): bytes each rank sends and time, quantization included; the
   result is checked against ``quantize`` of the concatenation;
3. ``cast_master_weights`` on a 100-weight Block2D + MXFP8 batch sharded over the ranks: time
   per call and collectives per call.
Rank 0 prints a table and writes ``DIR/comm-<machine>.json`` (machine ``h200`` on one GPU,
``h200x<N>`` on N).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import cupy
import numpy as np
from mpi4py import MPI

import fp8blk as fb
from bench import machine

WORLD = MPI.COMM_WORLD


def timed(fn, repeats=5, inner=10):
    """Median seconds per call over `repeats` runs of `inner` back-to-back calls."""
    stream = cupy.cuda.get_current_stream()
    fn()
    stream.synchronize()
    WORLD.Barrier()
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(inner):
            fn()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / inner)
        WORLD.Barrier()
    # The slowest rank decides a collective's time.
    return WORLD.allreduce(float(np.median(samples)), op=MPI.MAX)


def bench_all_gather(comm, results):
    from cupy.cuda import nccl

    n = comm.size
    for mib in (1, 16, 64, 256):
        count = mib * 2**20
        send = cupy.random.randint(0, 255, size=count, dtype=cupy.uint8)
        out = cupy.empty(count * n, dtype=cupy.uint8)
        ours = timed(lambda: comm.all_gather(send, out))
        stream = cupy.cuda.get_current_stream()
        raw = timed(lambda: comm.nccl_comm.allGather(send.data.ptr, out.data.ptr, count,
                                                     nccl.NCCL_UINT8, stream.ptr))
        bus = lambda t: out.nbytes / t * (n - 1) / n / 1e9  # noqa: E731
        results.append({"case": "all_gather", "mib_per_rank": mib, "ours_s": ours, "raw_s": raw,
                        "ours_busbw_gb_s": bus(ours), "raw_busbw_gb_s": bus(raw),
                        "ours_over_raw": ours / raw})


def bench_quantized_gather(comm, results):
    import torch

    rows, cols = 8192, 4096  # 64 MiB of bf16 per rank
    torch.manual_seed(comm.rank)
    local = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()

    comm.reset_stats()
    full_bf16, _ = fb.comm.gather_along_first_dim(local, comm)
    bf16_bytes = comm.stats.bytes
    comm.reset_stats()
    gathered, _ = fb.comm.gather_along_first_dim(local, comm, fb.Block1D())
    fp8_bytes, path = comm.stats.bytes, comm.stats.last_gather_path
    expected = fb.quantize(full_bf16, fb.Block1D())
    exact = bool(torch.equal(gathered.rowwise_data, expected.rowwise_data)
                 and torch.equal(gathered.rowwise_scale_inv, expected.rowwise_scale_inv))
    exact = WORLD.allreduce(exact, op=MPI.LAND)

    bf16_s = timed(lambda: fb.comm.gather_along_first_dim(local, comm), repeats=5, inner=5)
    fp8_s = timed(lambda: fb.comm.gather_along_first_dim(local, comm, fb.Block1D()),
                  repeats=5, inner=5)
    start = time.perf_counter()
    for _ in range(5):
        fb.comm.gather_along_first_dim(local, comm, fb.Block1D())
    torch.cuda.synchronize()
    fp8_wall = (time.perf_counter() - start) / 5
    results.append({"case": "gather_block1d_vs_bf16", "mib_per_rank": 64,
                    "bf16_bytes_per_rank": bf16_bytes, "fp8_bytes_per_rank": fp8_bytes,
                    "bytes_ratio": bf16_bytes / fp8_bytes, "bf16_s": bf16_s, "fp8_s": fp8_s,
                    "speedup": bf16_s / fp8_s, "fp8_wall_s": fp8_wall, "path": path,
                    "exact": exact})


def bench_master(comm, results):
    rng = np.random.default_rng(7)  # the same shapes and cuts on every rank
    shapes = [(int(rng.choice([256, 512, 1024, 1536])), int(rng.choice([256, 768, 1024, 2048])))
              for _ in range(100)]
    recipes = [fb.Block2D() if i % 2 else fb.MXFP8() for i in range(100)]
    weights, masters, offsets, fulls, cuts = [], [], [], [], []
    for (h, w), recipe in zip(shapes, recipes):
        full = cupy.asarray(rng.standard_normal(h * w, dtype=np.float32) * 0.02)
        bounds = np.concatenate([[0], np.sort(rng.integers(0, h * w, comm.size - 1)), [h * w]])
        lo, hi = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
        weights.append(fb.quantize(cupy.zeros((h, w), cupy.float32), recipe, rowwise=True,
                                   columnwise=isinstance(recipe, fb.MXFP8)))
        masters.append(full[lo:hi].copy())
        offsets.append(lo)
        fulls.append(full)
        cuts.append((lo, hi))
    comm.reset_stats()
    fb.cast_master_weights(weights, masters, offsets, comm)
    calls, payload = comm.stats.calls, comm.stats.bytes
    exact = True
    for weight, recipe, full, (lo, hi) in zip(weights, recipes, fulls, cuts):
        # Each rank checks the bytes it owns and the (replicated) scales.
        import torch

        bf16 = torch.from_dlpack(full).to(torch.bfloat16).reshape(weight.shape)
        expected = fb.quantize(bf16, recipe, rowwise=True, columnwise=weight.has_columnwise)
        got = cupy.asnumpy(weight._buffers[0]).reshape(-1)[lo:hi]
        want = expected.rowwise_data.cpu().numpy().reshape(-1)[lo:hi]
        exact &= bool(np.array_equal(got, want))
        exact &= bool(np.array_equal(cupy.asnumpy(weight._buffers[1]),
                                     expected.rowwise_scale_inv.cpu().numpy()))
    exact = WORLD.allreduce(exact, op=MPI.LAND)
    seconds = timed(lambda: fb.cast_master_weights(weights, masters, offsets, comm),
                    repeats=5, inner=3)
    start = time.perf_counter()
    for _ in range(3):
        fb.cast_master_weights(weights, masters, offsets, comm)
    cupy.cuda.get_current_stream().synchronize()
    wall = (time.perf_counter() - start) / 3
    results.append({"case": "cast_master_weights_100", "collectives_per_call": calls,
                    "payload_bytes": payload, "gpu_s": seconds, "wall_s": wall,
                    "exact": exact})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    comm = fb.comm.NCCLComm.from_mpi(WORLD)
    results = []
    for step in (bench_all_gather, bench_quantized_gather, bench_master):
        try:
            step(comm, results)
        except Exception as exc:  # keep the other measurements; report the failure
            results.append({"case": step.__name__, "error": f"{type(exc).__name__}: {exc}"})
            if comm.rank == 0:
                import traceback

                traceback.print_exc()
    if comm.rank == 0:
        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        record = {"machine": f"{comm.size}x {gpu}", "date": datetime.date.today().isoformat(),
                  "command": "mpiexec -n %d python3 -m mpi4py -m bench.bench_comm" % comm.size,
                  "host": platform.node(), "ranks": comm.size, "results": results}
        path = os.path.join(args.out, f"comm-{machine(gpu, comm.size)}.json")
        with open(path, "w") as handle:
            json.dump(record, handle, indent=1)
        for row in results:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
