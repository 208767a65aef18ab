"""``python -m fp8blk demo``: quantize a random matrix with every recipe (on the GPU when the
kernels can run there, else on the CPU) and print bytes stored, dequantization error and time;
``--distributed``, under ``mpiexec -n N``: a quantized all-gather and a sharded master-weight
cast over MPI, checked byte for byte against ``quantize`` of the unsharded data.
"""
from __future__ import annotations

import os
import time

import numpy as np

import fp8blk as fb
from fp8blk import _arrays
from fp8blk.formats import check_mxfp8_shape

from . import gpu_module

RECIPES = [
    ("Block1D E4M3", fb.Block1D(fb.E4M3)),
    ("Block2D E4M3", fb.Block2D(fb.E4M3)),
    ("MXFP8 E4M3", fb.MXFP8(fb.E4M3)),
    ("Block1D E5M2", fb.Block1D(fb.E5M2)),
]
DEFAULT_SHAPE = (2048, 2048)
# Bytes the demo holds per input element at its peak. Host: the float64 draw, the float32
# input, the dequantized copy and the error arrays (on the CPU also the FP8 copies and the
# reference's temporaries: 36 measured at 2048 x 2048). GPU: the input, the FP8 copies with
# their scales and the dequantized copy.
HOST_BYTES_PER_ELEMENT = 40
GPU_BYTES_PER_ELEMENT = 12


def check_shape(shape, cpu):
    """A usage-error message when an (M, K) float32 demo would not fit in memory (host RAM,
    and the GPU's free memory when it runs there), else None."""
    rows, cols = shape
    needs = [(rows * cols * HOST_BYTES_PER_ELEMENT, _host_available(), "this host has")]
    cupy = None if cpu else gpu_module()
    if cupy is not None:
        needs.append((rows * cols * GPU_BYTES_PER_ELEMENT, cupy.cuda.runtime.memGetInfo()[0],
                      "the GPU has"))
    for need, room, where in needs:
        if room is not None and need > room:
            return (f"--shape {rows} {cols} needs about {need / 2**30:,.1f} GiB; {where} "
                    f"{room / 2**30:,.1f} GiB available: choose a smaller shape")
    return None


def _host_available():
    """Bytes of host memory available now (None where the OS does not say): Linux's
    MemAvailable (free memory plus what the page cache would give back), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _nbytes(q):
    total = 0
    for buf in (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv):
        if buf is not None:
            total += buf.nbytes
    return total


def run(args) -> int:
    if args.distributed:
        return run_distributed(args.seed)
    xp = np if args.cpu else (gpu_module() or np)
    where = "GPU (CuPy)" if xp is not np else "CPU (NumPy reference)"
    rows, cols = args.shape or DEFAULT_SHAPE
    rng = np.random.default_rng(args.seed)
    # Rows of very different magnitudes: what block scaling is for.
    host = (rng.standard_normal((rows, cols)) *
            np.exp(rng.uniform(-2, 2, size=(rows, 1)))).astype(np.float32)
    x = xp.asarray(host)
    print(f"fp8blk {fb.__version__} demo on the {where}: x is {rows}x{cols} float32 "
          f"({host.nbytes / 2**20:.1f} MiB), rowwise + columnwise")
    print(f"{'recipe':<14}{'bytes stored':>14}{'vs fp32':>9}{'max rel err':>13}"
          f"{'rms rel err':>13}{'time ms':>10}")
    for name, recipe in RECIPES:
        try:
            check_mxfp8_shape(recipe, rows, cols, "x")
        except ValueError as refused:
            print(f"{name:<14}skipped: {refused}")
            continue
        fb.quantize(x, recipe, rowwise=True, columnwise=True)  # warm-up (kernel compilation)
        if xp is not np:
            xp.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        q = fb.quantize(x, recipe, rowwise=True, columnwise=True)
        if xp is not np:
            xp.cuda.runtime.deviceSynchronize()
        elapsed = time.perf_counter() - start
        back = q.dequantize(np.float32)
        back = back.get() if xp is not np else back
        # Relative to each row's amax: the error a block scale promises to bound.
        row_amax = np.abs(host).max(axis=1, keepdims=True)
        rel = np.abs(back - host) / row_amax
        print(f"{name:<14}{_nbytes(q):>14,}{_nbytes(q) / host.nbytes:>9.3f}"
              f"{rel.max():>13.2e}{np.sqrt((rel ** 2).mean()):>13.2e}{elapsed * 1e3:>10.1f}")
    return 0


# -- the distributed demo, under mpiexec -----------------------------------------------------


def _say(comm, text):
    if comm.rank == 0:
        print(text, flush=True)


def _gather_demo(comm, rng_seed):
    rows_per_rank, cols = 512, 4096
    full = np.random.default_rng(rng_seed).standard_normal(
        (rows_per_rank * comm.size, cols)).astype(_arrays.BF16)
    local = np.ascontiguousarray(full[comm.rank * rows_per_rank:(comm.rank + 1) * rows_per_rank])

    comm.reset_stats()
    start = time.perf_counter()
    plain, _ = fb.comm.gather_along_first_dim(local, comm)
    plain_s, plain_bytes = time.perf_counter() - start, comm.stats.bytes

    comm.reset_stats()
    start = time.perf_counter()
    quantized, _ = fb.comm.gather_along_first_dim(local, comm, fb.Block1D())
    fp8_s, fp8_bytes = time.perf_counter() - start, comm.stats.bytes

    expected = fb.quantize(full, fb.Block1D())
    exact = (np.array_equal(quantized.rowwise_data, expected.rowwise_data)
             and np.array_equal(quantized.rowwise_scale_inv, expected.rowwise_scale_inv)
             and np.array_equal(plain, full))
    _say(comm, f"all-gather of a {full.shape[0]}x{cols} bf16 tensor over {comm.size} ranks:\n"
               f"  bf16       {plain_bytes:>10,} bytes sent by each rank  {plain_s * 1e3:7.1f} ms\n"
               f"  Block1D    {fp8_bytes:>10,} bytes sent by each rank  {fp8_s * 1e3:7.1f} ms "
               f"(incl. quantize)\n"
               f"  equals quantize(concatenation) byte for byte: {exact}")
    return exact


def _master_demo(comm, rng_seed):
    shapes = [(1024, 768), (300, 257), (768, 3072), (96, 128)]  # (300, 257): Block2D edge tiles
    recipes = [fb.Block2D(), fb.Block2D(), fb.MXFP8(), fb.MXFP8()]
    rng = np.random.default_rng(rng_seed)
    full_masters = [rng.standard_normal(h * w).astype(np.float32) * 0.02 for h, w in shapes]
    weights, masters, offsets, cuts = [], [], [], []
    for (h, w), recipe, master in zip(shapes, recipes, full_masters):
        # Shard boundaries at arbitrary flat offsets (inside rows and blocks), the same on all
        # ranks because every rank draws them from the same seed.
        bounds = np.sort(rng.integers(0, h * w, size=comm.size - 1))
        bounds = np.concatenate([[0], bounds, [h * w]]).astype(int)
        lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
        weights.append(fb.quantize(np.zeros((h, w), np.float32), recipe, rowwise=True,
                                   columnwise=isinstance(recipe, fb.MXFP8)))
        masters.append(master[lo:hi])
        offsets.append(int(lo))
        cuts.append(bounds)

    comm.reset_stats()
    start = time.perf_counter()
    fb.cast_master_weights(weights, masters, offsets, comm)
    elapsed = time.perf_counter() - start
    collectives, payload = comm.stats.calls, comm.stats.bytes

    exact = True
    for weight, recipe, master, bounds in zip(weights, recipes, full_masters, cuts):
        expected = fb.quantize(master.astype(_arrays.BF16).reshape(weight.shape), recipe,
                               rowwise=True, columnwise=weight.has_columnwise)
        lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
        pairs = [(weight.rowwise_data, expected.rowwise_data),
                 (weight.columnwise_data, expected.columnwise_data)]
        for got, want in pairs:
            if got is None:
                continue
            # Put the ranks' owned byte ranges together, as an FSDP all-gather would.
            owned = np.ascontiguousarray(got.reshape(-1)[lo:hi])
            counts = [int(b - a) for a, b in zip(bounds[:-1], bounds[1:])]
            gathered = comm.all_gather_v(owned, counts)
            exact &= np.array_equal(gathered, want.reshape(-1))
        exact &= np.array_equal(weight.rowwise_scale_inv, expected.rowwise_scale_inv)
    _say(comm, f"cast_master_weights: {len(weights)} weights (Block2D and MXFP8), shards cut "
               f"at random flat offsets:\n"
               f"  {collectives} all-reduce(s), {payload:,} bytes per rank, "
               f"{elapsed * 1e3:.1f} ms\n"
               f"  gathered bytes equal quantize(bf16(full weight)): {exact}")
    return exact


def run_distributed(seed: int = 0) -> int:
    """The distributed demo, one call per MPI rank: a quantized all-gather along dim 0 and a
    master-weight cast from fp32 shards cut anywhere; exit status 1 on a mismatch."""
    from mpi4py import MPI

    comm = fb.comm.MPIComm(MPI.COMM_WORLD)
    _say(comm, f"\nfp8blk distributed demo: {comm.size} MPI ranks, host arrays")
    ok = _gather_demo(comm, seed)
    ok &= _master_demo(comm, seed + 1)
    ok = bool(MPI.COMM_WORLD.allreduce(ok, op=MPI.LAND))
    _say(comm, "all checks passed" if ok else "MISMATCH: see above")
    return 0 if ok else 1
