"""Scenarios for ``cast_master_weights`` tests, shared by the in-process (thread) tests, the MPI
scripts and the GPU tests.

A scenario is a list of :class:`Spec` (shape, recipe, which directions the weight holds, the
master dtype). Full master weights come from :func:`make_full`: random magnitudes per 32x32
region plus special regions (an all-NaN tile, a tile of tiny values whose scale overflows fp32,
zeros, huge values that round to bf16 inf, exact bf16 ties, scattered NaN and subnormals, +-inf
scattered in one tile), so the tiles' scales differ. Shards are cut
from the concatenation of all weights at random points (:func:`cut_ranges`), as a ZeRO flat
buffer would be, so most ranks own nothing of most weights and boundaries fall inside blocks.

Everything is a deterministic function of a seed, so every MPI rank builds the same scenario.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

import fp8blk as fb
from fp8blk.layout import buffer_layouts, cdiv

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Spec:
    shape: tuple
    recipe: object
    rowwise: bool = True
    columnwise: bool = False
    master_dtype: np.dtype = F32


# --------------------------------------------------------------------------------------------
# Scenarios

BLOCK2D_SHAPES = [(128, 128), (288, 768), (300, 257), (256, 96), (4064, 160)]
MXFP8_SHAPES = [(128, 128), (288, 768), (256, 96), (4064, 160)]


def scenario(name):
    """The weight list of a named scenario (the issue's shapes and recipe mixes)."""
    if name == "block2d_pow2":
        return [Spec(s, fb.Block2D(fb.E4M3, pow2_scales=True), columnwise=(i % 2 == 1))
                for i, s in enumerate(BLOCK2D_SHAPES)]
    if name == "block2d_nopow2":
        return [Spec(s, fb.Block2D(fmt, pow2_scales=False), columnwise=(i % 2 == 0),
                     master_dtype=BF16 if i == 3 else F32)
                for i, (s, fmt) in enumerate(zip(BLOCK2D_SHAPES,
                                                 [fb.E4M3, fb.E5M2, fb.E4M3, fb.E5M2, fb.E4M3]))]
    if name == "mxfp8_bidir":
        return [Spec(s, fb.MXFP8(fb.E4M3), columnwise=True) for s in MXFP8_SHAPES]
    if name == "mxfp8_rowonly":
        return [Spec(s, fb.MXFP8(fb.E5M2 if i % 2 else fb.E4M3), columnwise=False)
                for i, s in enumerate(MXFP8_SHAPES)]
    if name == "mxfp8_mixed":
        return [Spec(s, fb.MXFP8(fb.E4M3), columnwise=(i % 2 == 0),
                     master_dtype=BF16 if i == 1 else F32) for i, s in enumerate(MXFP8_SHAPES)]
    if name == "batch20":
        return batch20()
    raise KeyError(name)


SCENARIOS = ["block2d_pow2", "block2d_nopow2", "mxfp8_bidir", "mxfp8_rowonly", "mxfp8_mixed",
             "batch20"]


def batch20():
    """20 weights mixing every recipe variant, direction set and master dtype."""
    rng = np.random.default_rng(2024)
    recipes = [
        (fb.Block2D(fb.E4M3, True), True, False),
        (fb.Block2D(fb.E4M3, False, 1e-12), True, True),
        (fb.Block2D(fb.E5M2, False), True, False),
        (fb.Block2D(fb.E5M2, True), False, True),   # column-only Block2D
        (fb.MXFP8(fb.E4M3), True, True),
        (fb.MXFP8(fb.E4M3), True, False),
        (fb.MXFP8(fb.E5M2), True, True),
        (fb.MXFP8(fb.E5M2), False, True),           # column-only MXFP8
    ]
    specs = []
    for i in range(20):
        recipe, row, col = recipes[i % len(recipes)]
        if isinstance(recipe, fb.MXFP8):
            shape = (32 * int(rng.integers(1, 9)), 32 * int(rng.integers(1, 9)))
        else:
            shape = (int(rng.integers(1, 300)), int(rng.integers(1, 300)))
        specs.append(Spec(shape, recipe, row, col, BF16 if i % 5 == 4 else F32))
    return specs


# --------------------------------------------------------------------------------------------
# Data


def _region(rng, h, w, bh, bw):
    """Slices of one block-aligned (bh x bw) region, clipped to (h, w)."""
    r = int(rng.integers(0, cdiv(h, bh))) * bh
    c = int(rng.integers(0, cdiv(w, bw))) * bw
    return slice(r, min(r + bh, h)), slice(c, min(c + bw, w))


def make_full(rng, shape):
    """fp32 (h, w) master weight with wide magnitudes and special values (see module doc)."""
    h, w = shape
    mags = 2.0 ** rng.integers(-14, 14, size=(cdiv(h, 32), cdiv(w, 32)))
    x = rng.standard_normal((h, w)) * np.repeat(np.repeat(mags, 32, 0), 32, 1)[:h, :w]
    x = x.astype(np.float32)
    # Exact bf16 ties (low half-word 0x8000) test the round-to-nearest-even step.
    ties = rng.random((h, w)) < 0.05
    bits = x.view(np.uint32)
    bits[ties] = (bits[ties] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    big_blocks = h * w >= 4 * 128 * 128
    tile = (128, 128) if big_blocks else (32, 32)
    x[_region(rng, h, w, *tile)] = np.nan                  # all-NaN tile (or 32x32 block)
    tiny = _region(rng, h, w, *tile)                       # tiny: F/amax overflows fp32
    x[tiny] = (rng.standard_normal(x[tiny].shape) * 1e-37).astype(np.float32)
    x[_region(rng, h, w, 32, 32)] = 0.0                    # zero blocks
    x[_region(rng, h, w, 1, 32)] = np.nan                  # one all-NaN 1x32 row block
    x[_region(rng, h, w, 32, 1)] = np.nan                  # one all-NaN 32x1 column block
    x[_region(rng, h, w, 1, 32)] = np.float32(3.3e38) * rng.choice([-1, 1], size=1)[0]
    x[_region(rng, h, w, 1, 1)] = np.float32(3.4e38)       # rounds to bf16 inf
    scatter = rng.random((h, w))
    x[scatter < 2e-4] = np.nan
    x[(scatter >= 4e-4) & (scatter < 8e-4)] = np.float32(2.0 ** -133)  # fp32/bf16 subnormal
    # +-inf scattered inside ONE tile (1% each): a tile holding an inf gets scale 1, so infs
    # scattered over the whole weight (~3 per 128x128 tile) gave 96% of the tiles that same
    # scale and would hide a wrong tile amax
    region = _region(rng, h, w, *tile)
    sub, part = scatter[region], x[region]  # a view: writes reach x
    part[(sub >= 0.2) & (sub < 0.21)] = np.inf
    part[(sub >= 0.21) & (sub < 0.22)] = -np.inf
    return x


def step_full(rng, full):
    """The next optimizer step's weight: a small update, plus fresh special regions."""
    nxt = make_full(rng, full.shape)
    keep = np.isfinite(full) & np.isfinite(nxt)
    with np.errstate(all="ignore"):
        nxt[keep] = (full + np.float32(1e-2) * nxt)[keep]
    return nxt


def cut_ranges(rng, specs, size):
    """Per weight, per rank, the (start, count) this rank owns: the flat concatenation of all
    weights cut at random points into `size` ranges (sometimes empty ranges)."""
    sizes = [s.shape[0] * s.shape[1] for s in specs]
    total = sum(sizes)
    cuts = np.sort(rng.integers(0, total + 1, size=size - 1))
    if size >= 2 and rng.random() < 0.5:  # an empty rank
        k = int(rng.integers(0, size - 1))
        cuts[k] = cuts[k - 1] if k > 0 else 0
        cuts = np.sort(cuts)
    bounds = np.concatenate([[0], cuts, [total]]).astype(np.int64)
    ranges, base = [], 0
    for n in sizes:
        per_rank = []
        for r in range(size):
            lo, hi = max(bounds[r], base), min(bounds[r + 1], base + n)
            per_rank.append((int(lo - base), int(max(hi - lo, 0))) if hi > lo else (0, 0))
        ranges.append(per_rank)
        base += n
    return ranges


def model_values(spec, full, model_dtype=BF16):
    """What the model holds: the master (in its dtype) rounded once to the model dtype."""
    with np.errstate(over="ignore"):
        return full.astype(spec.master_dtype).astype(np.float32).astype(model_dtype)


# --------------------------------------------------------------------------------------------
# Per-rank call


def alloc_weight(spec, rng, xp=np):
    """A BlockTensor of the spec's shape, recipe and directions, its buffers full of garbage so
    that anything not written shows."""
    h, w = spec.shape
    r = spec.recipe
    bufs = []
    for layout in buffer_layouts(r, h, w, spec.rowwise, spec.columnwise):
        if layout is None:
            bufs.append(None)
            continue
        shape, dtype, _ = layout
        if dtype == np.uint8:
            b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        else:
            b = rng.standard_normal(shape).astype(np.float32)
        bufs.append(xp.asarray(b))
    return fb.BlockTensor(spec.shape, r, *bufs, dtype=BF16,
                          family="cupy" if xp is not np else "numpy")


def _to(xp, arr):
    """`arr` on xp's side; device bf16 goes through torch (CuPy has no bf16 dtype)."""
    if xp is np:
        return arr
    if arr.dtype == BF16:
        import torch

        return torch.from_numpy(arr.view(np.int16).copy()).cuda().view(torch.bfloat16)
    return xp.asarray(arr)


def rank_inputs(specs, fulls, ranges, rank, rng, xp=np):
    """(masters, starts) of one rank: a shard per weight, None or an empty array where it owns
    nothing."""
    masters, starts = [], []
    for spec, full, per_rank in zip(specs, fulls, ranges):
        o, n = per_rank[rank]
        if n == 0:
            masters.append(None if rng.random() < 0.5 else _to(
                xp, np.empty(0, spec.master_dtype)))
            starts.append(o)
            continue
        masters.append(_to(xp, full.reshape(-1)[o: o + n].astype(spec.master_dtype)))
        starts.append(o)
    return masters, starts


GUARD = 16  # garbage bytes on each side of a fragment, to catch out-of-range writes


def make_fragments(specs, ranges, rank, rng, xp=np):
    """Per weight the ``fragments`` entry of one rank (views into guarded garbage buffers), and
    per weight the guarded buffers, one per direction (None where not held)."""
    frags, guarded = [], []
    for spec, per_rank in zip(specs, ranges):
        n = per_rank[rank][1]
        block2d = isinstance(spec.recipe, fb.Block2D)
        views, bufs = [], []
        for held in ([spec.rowwise] if block2d else [spec.rowwise, spec.columnwise]):
            if not held:
                views.append(None)
                bufs.append(None)
                continue
            b = xp.asarray(rng.integers(0, 256, size=n + 2 * GUARD, dtype=np.uint8))
            bufs.append(b)
            views.append(b[GUARD: GUARD + n])
        if n == 0 and rng.random() < 0.5:
            frags.append(None)
        else:
            frags.append(views[0] if block2d else tuple(views))
        guarded.append(bufs)
    return frags, guarded


def expected_payload(specs):
    """(collective calls, Block2D bytes, MXFP8 bytes) of one call for this weight list."""
    b2 = sum(cdiv(s.shape[0], 128) * cdiv(s.shape[1], 128) for s in specs
             if isinstance(s.recipe, fb.Block2D))
    mx = sum((s.shape[0] * s.shape[1] // 32) * (int(s.rowwise) + int(s.columnwise))
             for s in specs if isinstance(s.recipe, fb.MXFP8))
    calls = int(any(isinstance(s.recipe, fb.Block2D) for s in specs)) + \
        int(any(isinstance(s.recipe, fb.MXFP8) for s in specs))
    return calls, 4 * b2, mx


# --------------------------------------------------------------------------------------------
# Checking


def expected_buffers(spec, full, model_dtype=BF16):
    """quantize(model dtype(full weight)) buffers (NumPy)."""
    x = model_values(spec, full, model_dtype)
    q = fb.quantize(x, spec.recipe, rowwise=spec.rowwise, columnwise=spec.columnwise)
    return [None if b is None else np.array(b) for b in q._buffers]


def _diff(name, got, want):
    got_b, want_b = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
    if got_b.shape != want_b.shape:
        return f"{name}: shape {got_b.shape} != {want_b.shape}"
    bad = np.flatnonzero(got_b.reshape(-1) != want_b.reshape(-1))
    if bad.size:
        return (f"{name}: {bad.size} bytes differ, first at flat {bad[0]} "
                f"(got {got_b.reshape(-1)[bad[0]]}, want {want_b.reshape(-1)[bad[0]]})")
    return None


def _host(a):
    return None if a is None else (a.get() if hasattr(a, "get") else np.asarray(a))


def gathered_data(spec, ranges, sources, direction):
    """The (h, w) rowwise / MXFP8 columnwise bytes, or the (w, h) Block2D columnwise bytes, put
    together from each rank's owned positions. `sources[r]` is rank r's full data buffer, or its
    fragment (flat, n bytes) when `is_fragment`."""
    h, w = spec.shape
    transposed = isinstance(spec.recipe, fb.Block2D) and direction == 1
    out = np.zeros(h * w, np.uint8)
    filled = np.zeros(h * w, bool)
    for (o, n), (src, is_fragment) in zip(ranges, sources):
        if n == 0:
            continue
        flat = np.arange(o, o + n, dtype=np.int64)
        pos = (flat % w) * h + flat // w if transposed else flat
        src = _host(src).reshape(-1)
        out[pos] = src if is_fragment else src[pos]
        filled[pos] = True
    assert filled.all(), f"{spec}: ranks' ranges do not cover the weight"
    return out.reshape((w, h) if transposed else (h, w))


def check(specs, fulls, ranges, rank_weights, rank_fragments=None, model_dtype=BF16):
    """Assert that the ranks' results equal quantize(model dtype(full weight)) byte for byte.

    rank_weights[r][i] is rank r's BlockTensor for weight i; rank_fragments[r][i] the fragment
    argument rank r passed (None: data was written in place)."""
    errors = []
    size = len(rank_weights)
    for i, (spec, full) in enumerate(zip(specs, fulls)):
        want = expected_buffers(spec, full, model_dtype)
        for d, held in ((0, spec.rowwise), (1, spec.columnwise)):
            if not held:
                continue
            sources = []
            for r in range(size):
                if rank_fragments is None:
                    sources.append((rank_weights[r][i]._buffers[2 * d], False))
                else:
                    frag = rank_fragments[r][i]
                    frag = frag[d] if isinstance(frag, tuple) else (frag if d == 0 else None)
                    sources.append((frag, True))
            if rank_fragments is not None and isinstance(spec.recipe, fb.Block2D) and d == 1:
                pass  # with fragments, Block2D columnwise data is not written
            else:
                got = gathered_data(spec, ranges[i], sources, d)
                err = _diff(f"weight {i} {spec} direction {d} data", got, want[2 * d])
                if err:
                    errors.append(err)
            for r in range(size):
                err = _diff(f"weight {i} {spec} direction {d} scale_inv on rank {r}",
                            _host(rank_weights[r][i]._buffers[2 * d + 1]), want[2 * d + 1])
                if err:
                    errors.append(err)
    assert not errors, "\n".join(errors[:20])


def snapshot(weights):
    """Copies of every buffer of a rank's weights (NumPy), to compare after a call."""
    return [[None if b is None else _host(b).copy() for b in w._buffers] for w in weights]


def check_untouched(specs, ranges, rank, before, weights, fragments_used, guarded=None,
                    guards=None):
    """Assert a rank wrote no data byte outside its [o, o+n) (Block2D columnwise: outside the
    transposed positions), none at all into the weight's data when fragments were used, and
    no fragment guard byte."""
    for i, spec in enumerate(specs):
        o, n = ranges[i][rank]
        h, w = spec.shape
        flat = np.arange(o, o + n, dtype=np.int64)
        for d in (0, 1):
            data = _host(weights[i]._buffers[2 * d])
            if data is None:
                continue
            old = before[i][2 * d]
            if fragments_used:
                assert np.array_equal(data, old), f"weight {i} {spec}: data written " \
                    f"although fragments were given"
                continue
            owned = np.zeros(h * w, bool)
            transposed = isinstance(spec.recipe, fb.Block2D) and d == 1
            owned[(flat % w) * h + flat // w if transposed else flat] = True
            bad = np.flatnonzero(data.reshape(-1)[~owned] != old.reshape(-1)[~owned])
            assert not bad.size, f"weight {i} {spec} direction {d}: {bad.size} bytes " \
                f"outside [{o}, {o + n}) changed"
        if guarded is not None:
            for g, g_old in zip(guarded[i], guards[i]):
                if g is None:
                    continue
                g, g_old = _host(g), _host(g_old)
                assert np.array_equal(g[:GUARD], g_old[:GUARD]) and \
                    np.array_equal(g[GUARD + n:], g_old[GUARD + n:]), \
                    f"weight {i} {spec}: fragment guard bytes changed"
