"""quantize (public path, host backend = fp8blk.reference) against the per-block loop oracle
``_oracles.quantize_loop``, byte for byte: data AND scale buffers including their padding.

Random data spans many binades per row/column and, in most tests, carries special blocks
(zeros, all-NaN, NaN/inf points, dtype max, subnormals, amaxes whose F/amax overflows).
"""
import itertools

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import reference
from tests import _oracles as O
from tests._same import assert_same_buffers, buffers

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16, np.float16]
FMTS = [fb.E4M3, fb.E5M2]


def check(x, recipe, rowwise=True, columnwise=True):
    q = fb.quantize(x, recipe, rowwise=rowwise, columnwise=columnwise)
    assert q.shape == x.shape and q.recipe == recipe
    m = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim > 1 else 1
    want = O.quantize_loop(x.reshape(m, x.shape[-1]), recipe, rowwise, columnwise)
    assert_same_buffers(buffers(q), want)
    return q


SMALL_SHAPES = [(1, 1), (1, 128), (127, 129), (128, 128), (256, 272), (303, 300),
                (3, 50, 130), (2, 1, 129)]
FP32_RECIPES = [cls(fmt, pow2, eps) for cls, fmt, pow2, eps in
                itertools.product([fb.Block1D, fb.Block2D], FMTS, [True, False], [0.0, 1e-12])]


@pytest.mark.parametrize("recipe", FP32_RECIPES, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
def test_fp32_scale_recipes_match_loop(shape, dtype, recipe, rng):
    check(O.random_input(rng, shape, dtype), recipe)


MX_SHAPES = [(32, 32), (64, 96), (128, 128), (256, 288), (32, 2048), (2, 64, 96), (4, 8, 32)]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
def test_mxfp8_matches_loop(shape, dtype, fmt, rng):
    check(O.random_input(rng, shape, dtype), fb.MXFP8(fmt))


@pytest.mark.parametrize("recipe", [fb.Block1D(fb.E5M2, False, 1e-12), fb.Block2D(),
                                    fb.MXFP8()], ids=repr)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_one_direction_only(recipe, rowwise, columnwise, rng):
    shape = (96, 160) if isinstance(recipe, fb.MXFP8) else (130, 259)
    dtype = DTYPES[int(rng.integers(0, 3))]
    check(O.random_input(rng, shape, dtype), recipe, rowwise, columnwise)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_plain_random_data_without_specials(dtype, rng):
    """No special blocks at all: every block's scale comes from the division path."""
    for recipe in (fb.Block1D(fb.E4M3, False), fb.Block2D(fb.E5M2), fb.MXFP8(fb.E5M2)):
        check(O.random_input(rng, (160, 192), dtype, specials=False), recipe)


# The large shape, for a few combinations only (the loop oracle costs ~10 us per block).
@pytest.mark.parametrize("dtype,recipe", [
    (BF16, fb.Block1D(fb.E4M3, True, 0.0)),
    (np.float32, fb.Block1D(fb.E5M2, False, 1e-12)),
    (np.float16, fb.Block2D(fb.E4M3, False, 1e-12)),
    (BF16, fb.Block2D(fb.E5M2, True, 0.0)),
], ids=str)
def test_large_2000x2048(dtype, recipe, rng):
    check(O.random_input(rng, (2000, 2048), dtype), recipe)


def test_large_mxfp8(rng):
    # 2000 is not a multiple of 32; the nearest larger MXFP8-legal M is 2016.
    check(O.random_input(rng, (2016, 2048), BF16), fb.MXFP8(fb.E4M3))


# --------------------------------------------------------------------------------------------
# Layouts and padding (docs/layouts.md), stated explicitly


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_layout_shapes_and_padding(dtype, rng):
    m, k = 130, 259
    x = O.random_input(rng, (m, k), dtype)
    rd, rs, cd, cs = reference.quantize(x, fb.Block1D(), True, True)
    assert rd.shape == (m, k) and rs.shape == (3, 132) and cd.shape == (k, m)
    assert cs.shape == (2, 260)
    assert np.all(rs[:, m:] == 1.0) and np.all(cs[:, k:] == 1.0)
    rd, rs, cd, cs = reference.quantize(x, fb.Block2D(), True, True)
    assert rs.shape == (2, 4) and cs.shape == (3, 4)
    assert np.all(rs[:, 3:] == 1.0) and np.all(cs[:, 2:] == 1.0)
    assert np.array_equal(cd, rd.T)
    for buf in (rd, rs, cd, cs):
        assert buf.flags.c_contiguous
    m, k = 96, 160
    x = O.random_input(rng, (m, k), dtype)
    rd, rs, cd, cs = reference.quantize(x, fb.MXFP8(), True, True)
    assert rd.shape == (m, k) and cd.shape == (m, k)
    assert rs.shape == (128, 8) and rs.dtype == np.uint8
    assert cs.shape == (4, 256) and cs.dtype == np.uint8
    assert np.all(rs[m:] == 0) and np.all(rs[:, 5:] == 0)
    assert np.all(cs[3:] == 0) and np.all(cs[:, k:] == 0)


def test_dtype_value_for_inf_differs_by_input_dtype():
    """A block of fp32/bf16 subnormals: F/amax overflows, the scale is the input dtype's max
    (non-pow2) or 2**127 (pow2), so fp32 and bf16 inputs with equal values get different
    scale_inv buffers without pow2."""
    x32 = np.full((1, 128), 2.0 ** -130, dtype=np.float32)
    xbf = x32.astype(BF16)
    r = fb.Block1D(fb.E4M3, pow2_scales=False)
    s32 = fb.quantize(x32, r).rowwise_scale_inv[0, 0]
    sbf = fb.quantize(xbf, r).rowwise_scale_inv[0, 0]
    assert s32 == np.float32(1) / np.float32(O.FLT_MAX)
    assert sbf == np.float32(1) / np.float32(O.BF16_MAX)
    for x in (x32, xbf):
        assert fb.quantize(x, fb.Block1D()).rowwise_scale_inv[0, 0] == np.float32(2.0 ** -127)
