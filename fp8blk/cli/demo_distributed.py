"""The distributed half of ``python -m fp8blk demo``, run under ``mpiexec -n N``.

Two things a data-parallel FP8 training step does, on host arrays over MPI (NCCL on GPUs):

1. quantized all-gather along dim 0 (sequence-parallel activations): each rank quantizes its
   rows and the ranks exchange FP8 bytes + scales instead of bf16;
2. master-weight cast: each rank owns a flat fp32 shard of every weight (cut anywhere, also
   inside blocks); one packed all-reduce of block amaxes per recipe, then each rank casts the
   bytes it owns.

Every result is checked byte for byte against ``quantize`` of the unsharded data.
"""
from __future__ import annotations

import time

import numpy as np

import fp8blk as fb
from fp8blk import _arrays


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


def run(seed: int = 0) -> int:
    from mpi4py import MPI

    comm = fb.comm.MPIComm(MPI.COMM_WORLD)
    _say(comm, f"\nfp8blk distributed demo: {comm.size} MPI ranks, host arrays")
    ok = _gather_demo(comm, seed)
    ok &= _master_demo(comm, seed + 1)
    ok = bool(MPI.COMM_WORLD.allreduce(ok, op=MPI.LAND))
    _say(comm, "all checks passed" if ok else "MISMATCH: see above")
    return 0 if ok else 1
