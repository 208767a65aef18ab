"""reference.partial_amax / partial_cast (the master-weight path, docs/distributed.md): over many splits
of a bf16 weight into 1..5 contiguous flat shards (boundaries inside blocks, on block edges
+-1, at row ends, empty shards), the per-shard amaxes combined with a max and turned into
scales, then the per-shard casts, reproduce quantize(full weight) byte for byte."""
import itertools

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import reference, scaling
from tests import _oracles as O

BF16 = ml_dtypes.bfloat16


def loop_block_amax(x2d, br, bc):
    """Per-block amax by a loop (NaN ignored, 0 for no element)."""
    rows, cols = x2d.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    out = np.zeros((nr, nc), dtype=np.float32)
    for i in range(nr):
        for j in range(nc):
            out[i, j] = O.block_amax(x2d[i * br:(i + 1) * br, j * bc:(j + 1) * bc])
    return out


def candidate_cuts(h, w, br, bc):
    """Flat offsets where shard boundaries hurt most: block-row edges, block-column edges
    inside a few rows, row ends, each +-1, and both ends of the weight."""
    n = h * w
    cuts = {0, n, 1, n - 1}
    for r in range(0, h + 1, br):
        cuts.update({r * w - 1, r * w, r * w + 1})
    for r in sorted({0, 1, h // 2, h - 1}):
        for c in range(0, w + 1, bc):
            cuts.update({r * w + c - 1, r * w + c, r * w + c + 1})
        cuts.update({r * w + w - 1, (r + 1) * w})
    return sorted(c for c in cuts if 0 <= c <= n)


def splits(rng, h, w, br, bc, count):
    """Lists of cut points (sorted, repeats allowed => empty shards) for 1..5 shards."""
    n = h * w
    cands = candidate_cuts(h, w, br, bc)
    out = [[], [0], [n], [0, 0, n, n]]  # one shard; empty first / last shards
    for i in range(count):
        shards = 1 + i % 5
        if i % 2:
            cuts = rng.choice(cands, size=shards - 1, replace=True)
        else:
            cuts = rng.integers(0, n, size=shards - 1, endpoint=True)
        out.append(sorted(int(c) for c in cuts))
    return out


def shards_of(flat, cuts):
    bounds = [0, *cuts, flat.size]
    return [(a, flat[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def run_split(weight, recipe, cuts, check_partials):
    h, w = weight.shape
    flat = weight.reshape(-1)
    is_mx = isinstance(recipe, fb.MXFP8)
    row_amax = col_amax = None
    pieces = shards_of(flat, cuts)
    for start, shard in pieces:
        r, c = reference.partial_amax(shard, (h, w), start, recipe, columnwise=True)
        if check_partials:
            # each shard alone: its elements' block maxima, 0 for blocks it does not touch
            alone = np.full(h * w, np.nan, dtype=np.float32)
            alone[start:start + shard.size] = shard.astype(np.float32)
            alone = alone.reshape(h, w)
            if is_mx:
                assert np.array_equal(r, loop_block_amax(alone, 1, 32))
                assert np.array_equal(c, loop_block_amax(alone, 32, 1))
            else:
                assert np.array_equal(r, loop_block_amax(alone, 128, 128)) and c is None
        row_amax = r if row_amax is None else np.fmax(row_amax, r)
        if is_mx:
            col_amax = c if col_amax is None else np.fmax(col_amax, c)

    full = reference.quantize(weight, recipe, rowwise=True, columnwise=True)
    row_bytes = np.full(h * w, 0xAA, dtype=np.uint8)
    col_bytes = np.full(h * w, 0xAA, dtype=np.uint8)
    if is_mx:
        row_codes = scaling.e8m0_from_amax(row_amax, recipe.fmt)
        col_codes = scaling.e8m0_from_amax(col_amax, recipe.fmt)
        assert np.array_equal(row_codes, full[1][:h, :w // 32])
        assert np.array_equal(col_codes, full[3][:h // 32, :w])
        for start, shard in pieces:
            rb, cb = reference.partial_cast(shard, (h, w), start, recipe, row_codes, col_codes)
            assert rb.dtype == np.uint8 and rb.shape == (shard.size,) and cb.shape == rb.shape
            row_bytes[start:start + shard.size] = rb
            col_bytes[start:start + shard.size] = cb
        assert np.array_equal(row_bytes.reshape(h, w), full[0])
        assert np.array_equal(col_bytes.reshape(h, w), full[2])  # MXFP8 columnwise is (h, w)
    else:
        scale = scaling.fp32_scale_from_amax(row_amax, recipe.fmt, recipe.pow2_scales,
                                             recipe.amax_epsilon, scaling.dtype_max(BF16))
        sinv = scaling.scale_inv_from_scale(scale)
        mt, kt = sinv.shape
        assert np.array_equal(sinv.view(np.uint32), full[1][:mt, :kt].view(np.uint32))
        assert np.array_equal(sinv.T.view(np.uint32), full[3][:kt, :mt].view(np.uint32))
        for start, shard in pieces:
            rb, cb = reference.partial_cast(shard, (h, w), start, recipe, scale)
            assert cb is None and rb.dtype == np.uint8 and rb.shape == (shard.size,)
            row_bytes[start:start + shard.size] = rb
        assert np.array_equal(row_bytes.reshape(h, w), full[0])
        # Block2D columnwise is the transpose: each shard's bytes at their transposed places
        assert np.array_equal(row_bytes.reshape(h, w).T, full[2])


def weight(rng, shape):
    x = O.random_input(rng, shape, BF16)
    # make sure at least one block is all NaN and split by most cut sets
    x[: min(2, shape[0]), : min(40, shape[1])] = np.nan
    return x


BLOCK2D_SHAPES = [(300, 260), (128, 128), (129, 1), (1, 300), (256, 384)]
BLOCK2D_RECIPES = [fb.Block2D(fb.E4M3, True, 0.0), fb.Block2D(fb.E5M2, False, 1e-12),
                   fb.Block2D(fb.E4M3, False, 0.0)]


@pytest.mark.parametrize("recipe", BLOCK2D_RECIPES, ids=repr)
@pytest.mark.parametrize("shape", BLOCK2D_SHAPES, ids=str)
def test_block2d_splits_reproduce_quantize(shape, recipe, rng):
    w = weight(rng, shape)
    for i, cuts in enumerate(splits(rng, *shape, 128, 128, count=40)):
        run_split(w, recipe, cuts, check_partials=i % 4 == 0)


MX_SHAPES = [(96, 64), (64, 160), (32, 32), (128, 96)]


@pytest.mark.parametrize("fmt", [fb.E4M3, fb.E5M2])
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
def test_mxfp8_splits_reproduce_quantize(shape, fmt, rng):
    w = weight(rng, shape)
    # cuts near 1x32 block edges and near the 32-row edges of the 32x1 blocks
    for i, cuts in enumerate(splits(rng, *shape, 32, 32, count=40)):
        run_split(w, fb.MXFP8(fmt), cuts, check_partials=i % 4 == 0)


def test_every_two_shard_split_of_a_small_weight(rng):
    """Exhaustive over every single cut point of small weights (2 shards)."""
    w2 = weight(rng, (130, 3))
    for cut in range(w2.size + 1):
        run_split(w2, fb.Block2D(fb.E4M3, False), [cut], check_partials=False)
    wm = weight(rng, (32, 64))
    for cut in range(0, wm.size + 1, 7):
        run_split(wm, fb.MXFP8(), [cut], check_partials=False)


def test_partial_amax_untouched_and_empty():
    shape = (256, 256)
    r, c = reference.partial_amax(np.zeros(0, BF16), shape, 1000, fb.Block2D())
    assert r.shape == (2, 2) and c is None and np.all(r == 0)
    r, c = reference.partial_amax(np.zeros(0, BF16), (64, 64), 0, fb.MXFP8())
    assert r.shape == (64, 2) and c.shape == (2, 64) and np.all(r == 0) and np.all(c == 0)
    r, c = reference.partial_amax(np.ones(10, np.float32), (64, 64), 0, fb.MXFP8(),
                                  columnwise=False)
    assert c is None and r[0, 0] == 1.0 and np.all(r.ravel()[1:] == 0)
    shard = np.full(5, np.nan, dtype=np.float32)  # all-NaN touched elements: amax 0, never NaN
    r, _ = reference.partial_amax(shard, shape, 3, fb.Block2D())
    assert not np.isnan(r).any() and np.all(r == 0)
    rb, cb = reference.partial_cast(np.zeros(0, BF16), (64, 64), 64, fb.MXFP8(),
                                    np.zeros((64, 2), np.uint8), np.zeros((2, 64), np.uint8))
    assert rb.shape == (0,) and cb.shape == (0,)


@pytest.mark.parametrize("start,n", [(-1, 4), (4090, 7), (4096, 1)])
def test_partial_shard_outside_weight(start, n):
    shard = np.ones(n, np.float32)
    with pytest.raises(ValueError, match="outside"):
        reference.partial_amax(shard, (64, 64), start, fb.Block2D())
    with pytest.raises(ValueError, match="outside"):
        reference.partial_cast(shard, (64, 64), start, fb.Block2D(), np.ones((1, 1), np.float32))


def test_partial_rejects_block1d():
    with pytest.raises(TypeError):
        reference.partial_amax(np.ones(4, np.float32), (2, 2), 0, fb.Block1D())
    with pytest.raises(TypeError):
        reference.partial_cast(np.ones(4, np.float32), (2, 2), 0, fb.Block1D(),
                               np.ones((1, 1), np.float32))


def test_partial_accepts_fp32_and_fp16_shards(rng):
    """Shards in any supported dtype; results equal those of the same values in fp32."""
    x = rng.standard_normal(200).astype(np.float16)
    for recipe in (fb.Block2D(), fb.MXFP8()):
        a16 = reference.partial_amax(x, (64, 64), 100, recipe)
        a32 = reference.partial_amax(x.astype(np.float32), (64, 64), 100, recipe)
        for p, q in itertools.zip_longest(a16, a32):
            assert (p is None and q is None) or np.array_equal(p, q)
