"""Kernel-level checks of the master-weight path, byte for byte against the reference, on
NumPy arrays under the Numba simulator (tests/master/scripts/sim_checks.py, tiny shapes) or on
CuPy arrays on a GPU (the ``gpu`` tests, larger shapes). ``xp`` is numpy or cupy.
"""
import numpy as np

import fp8blk as fb
from fp8blk import master, reference, scaling
from fp8blk.kernels import partial
from tests.master.scripts import cases
from tests.master.scripts.fake_comm import run_ranks


def _shard(full, spec, o, n, misalign, xp):
    """The master shard as the kernels see it; `misalign` puts it one element past an aligned
    address (no vector loads)."""
    flat = full.reshape(-1)[o: o + n].astype(spec.master_dtype)
    if not misalign:
        return cases._to(xp, flat)
    holder = np.zeros(n + 8, spec.master_dtype)
    holder[1: 1 + n] = flat
    return cases._to(xp, holder)[1: 1 + n]


def _random_cut(rng, spec):
    total = spec.shape[0] * spec.shape[1]
    o = int(rng.integers(0, total // 3))
    return o, int(rng.integers(1, total - o + 1))


def check_amax(rng, xp=np, scale=1):
    """One batch per bucket (several weights, one launch per specialization), shards at
    unaligned offsets, fp32 and bf16 masters, model dtypes, misaligned master pointers.
    `scale` multiplies the first dimension of every weight (GPU runs use larger ones)."""
    configs = [
        # (specs, (o, n) per weight, misalign per weight, model dtype)
        ([cases.Spec((150, 36), fb.Block2D(fb.E4M3, False)),
          cases.Spec((3, 260), fb.Block2D(fb.E5M2, True), master_dtype=cases.BF16),
          cases.Spec((40, 40), fb.Block2D())],
         [(37, 150 * 36 - 40), (4, 3 * 260 - 4), (0, 0)], [False, True, False], cases.BF16),
        ([cases.Spec((64, 32), fb.MXFP8(fb.E4M3), columnwise=True),
          cases.Spec((32, 96), fb.MXFP8(fb.E5M2), columnwise=False),
          cases.Spec((32, 32), fb.MXFP8(fb.E4M3), rowwise=False, columnwise=True,
                     master_dtype=cases.BF16)],
         [(33, 64 * 32 - 50), (8, 32 * 96 - 8), (1, 1000)], [False, True, False], np.float32),
        ([cases.Spec((32, 64), fb.MXFP8(fb.E4M3), columnwise=True)],
         [(64, 32 * 64 - 64)], [False], np.float16),
    ]
    for specs, ranges, misalign, model_dtype in configs:
        if scale != 1:
            specs = [cases.Spec((s.shape[0] * scale, s.shape[1]), s.recipe, s.rowwise,
                                s.columnwise, s.master_dtype) for s in specs]
            ranges = [(o, n * scale) if n else (0, 0) for o, n in ranges]
        # the listed cuts, then random ones (ends at every residue mod 4 over the seeds)
        ranges = [(o, n) if rng.random() < 0.4 or not n else _random_cut(rng, s)
                  for (o, n), s in zip(ranges, specs)]
        _check_amax_batch(rng, specs, ranges, misalign, model_dtype, xp)


def _check_amax_batch(rng, specs, ranges, misalign, model_dtype, xp, make_full=None):
    """Partial amaxes of one batch (weights `specs`, shard (o, n) per weight) against the
    reference."""
    fulls = [(make_full or cases.make_full)(rng, s.shape) for s in specs]
    weights = [cases.alloc_weight(s, rng, xp=xp) for s in specs]
    masters = [_shard(f, s, o, n, m, xp) if n else None
               for f, s, (o, n), m in zip(fulls, specs, ranges, misalign)]
    items, _ = master.validate(weights, masters, [o for o, _ in ranges], None)
    batch = partial.Batch(items, have_fragments=False)
    buf = batch.new_buffer()
    partial.launch_partial_amax(batch, buf, partial.model_kind(model_dtype))
    for it in batch.items:
        o, n = it.start, it.count
        table = batch.table.reshape(-1, partial.NF)
        row_off = int(table[batch.items.index(it), partial.F_ROWBUF])
        host = None if not n else cases._host(it.master)
        if host is not None and it.master_dtype == cases.BF16:
            host = host.view(cases.BF16)
        with np.errstate(over="ignore"):
            shard = (np.zeros(0, np.float32) if not n else
                     host.astype(np.float32).astype(model_dtype))
        row, col = reference.partial_amax(shard, (it.h, it.w), o, it.recipe,
                                          columnwise=it.columnwise)
        if isinstance(it.recipe, fb.Block2D):
            want = [row.reshape(-1)]
        else:
            want = []
            if it.rowwise:
                want.append(scaling.e8m0_from_amax(row, it.recipe.fmt).reshape(-1))
            if it.columnwise:
                want.append(scaling.e8m0_from_amax(col, it.recipe.fmt).reshape(-1))
        want = np.concatenate(want)
        got = cases._host(buf)[row_off: row_off + want.size]
        bad = np.flatnonzero(got.view(np.uint8 if got.dtype == np.uint8 else np.uint32)
                             != want.view(np.uint8 if want.dtype == np.uint8 else np.uint32))
        assert not bad.size, (f"partial amax of weights[{it.index}] {it.recipe} "
                              f"{(it.h, it.w)} [{o}, {o + n}): {bad.size} entries differ, "
                              f"first {bad[0]}: got {got[bad[0]]}, want {want[bad[0]]}")


def check_fast_paths(rng, xp=np, scale=1):
    """Weights big enough for the kernels' interior fast paths (whole 128x128 tiles and
    32x512 MXFP8 bands inside an aligned shard; 4096-element cast chunks with o % 4 == w % 4
    == 0) next to edge blocks that take the general path, in one batch: partial amaxes
    against the reference, then the whole device path against quantize(bf16(full))."""
    def make_full(rng, shape):
        # infs and near-max values give their tile scale 1 or a tiny one whatever the other
        # amaxes are: keep them out of the interior tiles the fast paths take (the last 32
        # rows only), so that a wrong tile amax there shows
        x = cases.make_full(rng, shape)
        top = x[:-32]
        big = np.isinf(top) | (np.abs(top) > np.float32(1e38))
        top[big] = rng.standard_normal(int(big.sum())).astype(np.float32)
        return x

    # three band rows each (Block2D: 128-row tiles, MXFP8: 32-row bands): the shard cuts the
    # first and the last, so the general kernels get a head and a tail row and the fast ones
    # the middle; the bf16 MXFP8 shard starts on a band (a fast head, a general tail)
    specs = [cases.Spec((384 * scale, 256), fb.Block2D(fb.E4M3, False)),
             cases.Spec((96 * scale, 544), fb.MXFP8(fb.E4M3), columnwise=True),
             cases.Spec((64 * scale, 544), fb.MXFP8(fb.E5M2), master_dtype=cases.BF16)]
    sizes = [s.shape[0] * s.shape[1] for s in specs]
    amax_ranges = [(12, sizes[0] - 28), (8, sizes[1] - 24), (0, sizes[2] - 16)]
    _check_amax_batch(rng, specs[:1], amax_ranges[:1], [False], cases.BF16, xp, make_full)
    _check_amax_batch(rng, specs[1:], amax_ranges[1:], [False, False], np.float32, xp,
                      make_full)
    fulls = [make_full(rng, s.shape) for s in specs]
    ranges = [[(0, o), (o, size - o)] for size, (o, _) in zip(sizes, amax_ranges)]
    weights, _, _ = device_run(specs, fulls, ranges, 2, 4, False, cases.BF16, xp)
    cases.check(specs, fulls, ranges, weights)


def device_run(specs, fulls, ranges, size, seed, fragments, model_dtype, xp):
    """Every rank's device-path call (CUDA kernels on CuPy arrays, or on NumPy arrays under the
    simulator), on `size` thread-ranks; also checks each rank wrote nothing outside its range.
    Returns (weights, fragments (None without), comm stats), each per rank."""
    def body(rank, comm):
        r = np.random.default_rng([seed, rank])
        ws = [cases.alloc_weight(s, r, xp=xp) for s in specs]
        before = cases.snapshot(ws)
        masters, starts = cases.rank_inputs(specs, fulls, ranges, rank, r, xp=xp)
        frags, guarded = cases.make_fragments(specs, ranges, rank, r, xp=xp) if fragments \
            else (None, None)
        guards = None if guarded is None else \
            [[None if g is None else g.copy() for g in gs] for gs in guarded]
        items, _ = master.validate(ws, masters, starts, frags)
        master.cast_batch(items, comm, np.dtype(model_dtype), frags is not None, device=True)
        cases.check_untouched(specs, ranges, rank, before, ws, fragments, guarded, guards)
        return ws, frags, comm.stats
    out = run_ranks(size, body)
    return [o[0] for o in out], ([o[1] for o in out] if fragments else None), [o[2] for o in out]


def check_cast(rng, xp=np, scale=1):
    """The whole device path (amax, fake all-reduce, scales, cast) on thread-ranks, against
    quantize(model dtype(full weight)): both buckets, row-only / bidirectional / column-only,
    Block2D transposed columnwise data, fragments, fp32 and bf16 masters, groups of 4 that
    cross tile, block and row boundaries, partial groups at shard ends. `scale` multiplies
    the first dimension of the batch weights."""
    def big(s):
        return cases.Spec((s.shape[0] * scale, s.shape[1]), s.recipe, s.rowwise, s.columnwise,
                          s.master_dtype)
    specs = [cases.Spec((150, 36), fb.Block2D(fb.E4M3, False), columnwise=True),
             cases.Spec((3, 260), fb.Block2D(fb.E5M2, True), master_dtype=cases.BF16),
             cases.Spec((64, 32), fb.MXFP8(fb.E4M3), columnwise=True),
             cases.Spec((32, 96), fb.MXFP8(fb.E5M2), columnwise=False),
             cases.Spec((32, 32), fb.MXFP8(fb.E4M3), rowwise=False, columnwise=True,
                        master_dtype=cases.BF16)]
    specs = [big(s) for s in specs]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, 2)
    weights, _, _ = device_run(specs, fulls, ranges, 2, 1, False, cases.BF16, xp)
    cases.check(specs, fulls, ranges, weights)
    # hand-picked cuts: o % 4 != 0 so groups straddle the 128-column tile edges, 32-column
    # block edges and (w = 302) row ends; shard ends inside a group
    specs2 = [cases.Spec((2, 302), fb.Block2D(fb.E4M3, False), columnwise=True),
              cases.Spec((32, 64), fb.MXFP8(fb.E4M3), columnwise=True)]
    fulls2 = [cases.make_full(rng, s.shape) for s in specs2]
    for f in fulls2:  # distinct magnitudes per 32 columns: every block has its own scale
        f *= np.float32(2.0) ** np.repeat(np.arange(f.shape[1] // 32 + 1) % 7, 32)[: f.shape[1]]
    ranges2 = [[(0, 1), (1, 2 * 302 - 1)], [(0, 7), (7, 32 * 64 - 7)]]
    weights, _, _ = device_run(specs2, fulls2, ranges2, 2, 3, False, cases.BF16, xp)
    cases.check(specs2, fulls2, ranges2, weights)
    # fragments (no column-only Block2D there), 3 ranks, fp32 model dtype
    specs = [specs[0], specs[2], specs[3]]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, 3)
    weights, frags, _ = device_run(specs, fulls, ranges, 3, 2, True, np.float32, xp)
    cases.check(specs, fulls, ranges, weights, rank_fragments=frags,
                model_dtype=np.dtype(np.float32))
