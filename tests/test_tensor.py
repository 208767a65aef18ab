"""BlockTensor: buffers, dequantize, create_columnwise (Block2D) and update_usage."""
import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import reference
from tests import _oracles as O
from tests._same import assert_same_buffers, buffers

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16, np.float16]
RECIPES = [fb.Block1D(), fb.Block1D(fb.E5M2, False, 1e-12), fb.Block2D(),
           fb.Block2D(fb.E5M2, False, 1e-12), fb.MXFP8(), fb.MXFP8(fb.E5M2)]


def shape_for(recipe):
    return (96, 160) if isinstance(recipe, fb.MXFP8) else (130, 259)


# --------------------------------------------------------------------------------------------
# create_columnwise


@pytest.mark.parametrize("recipe", [fb.Block2D(), fb.Block2D(fb.E5M2, False, 1e-12)], ids=repr)
@pytest.mark.parametrize("shape", [(1, 1), (130, 259), (384, 128), (5, 600), (2, 70, 140)],
                         ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_block2d_create_columnwise_equals_quantize_columnwise(shape, dtype, recipe, rng):
    x = O.random_input(rng, shape, dtype)
    q = fb.quantize(x, recipe)
    assert not q.has_columnwise and q.columnwise_data is None
    assert q.create_columnwise() is q
    want = fb.quantize(x, recipe, rowwise=False, columnwise=True)
    assert_same_buffers(buffers(q)[2:], buffers(want)[2:])
    # padding of the transposed scales is 1.0 (docs/layouts.md)
    m = int(np.prod(shape[:-1]))
    mt, kt = -(-m // 128), -(-shape[-1] // 128)
    assert q.columnwise_scale_inv.shape == (kt, -(-mt // 4) * 4)
    assert np.all(q.columnwise_scale_inv[:, mt:] == 1.0)
    assert np.array_equal(q.columnwise_data, q.rowwise_data.T)


def test_create_columnwise_overwrites_existing_buffers_in_place(rng):
    x = O.random_input(rng, (200, 300), np.float32)
    q = fb.quantize(x, fb.Block2D(), rowwise=True, columnwise=True)
    col_data, col_sinv = q.columnwise_data, q.columnwise_scale_inv
    want = (col_data.copy(), col_sinv.copy())
    col_data[...] = 0
    col_sinv[...] = 0
    q.create_columnwise()
    assert q.columnwise_data is col_data and q.columnwise_scale_inv is col_sinv
    assert np.array_equal(col_data, want[0]) and np.array_equal(col_sinv, want[1])


def test_block2d_columnwise_from_rowwise_with_out(rng):
    x = O.random_input(rng, (300, 129), BF16)
    rd, rs, cd, cs = reference.quantize(x, fb.Block2D(), True, True)
    out = (np.empty_like(cd), np.empty_like(cs))
    d, s = reference.block2d_columnwise_from_rowwise(rd, rs, out=out)
    assert d is out[0] and s is out[1]
    assert np.array_equal(d, cd) and np.array_equal(s, cs)
    d2, s2 = reference.block2d_columnwise_from_rowwise(rd, rs)
    assert np.array_equal(d2, cd) and np.array_equal(s2, cs)


@pytest.mark.parametrize("recipe", [fb.Block1D(), fb.MXFP8()], ids=repr)
def test_create_columnwise_needs_block2d(recipe, rng):
    q = fb.quantize(O.random_input(rng, (64, 64), np.float32), recipe)
    with pytest.raises(ValueError, match="columnwise=True"):
        q.create_columnwise()


def test_create_columnwise_needs_rowwise(rng):
    q = fb.quantize(O.random_input(rng, (64, 64), np.float32), fb.Block2D(), rowwise=False,
                    columnwise=True)
    with pytest.raises(ValueError, match="rowwise"):
        q.create_columnwise()


# --------------------------------------------------------------------------------------------
# update_usage


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_update_usage_drop_and_keep(recipe, rng):
    x = O.random_input(rng, shape_for(recipe), np.float32)
    q = fb.quantize(x, recipe, rowwise=True, columnwise=True)
    full = [None if b is None else b.copy() for b in buffers(q)]
    assert q.update_usage() is q and q.has_rowwise and q.has_columnwise  # None: no change
    assert q.update_usage(rowwise=True, columnwise=True) is q
    assert_same_buffers(buffers(q), full)
    m, k = shape_for(recipe)
    row_deq = O.dequantize_loop(recipe, (m, k), full, rowwise=True)
    col_deq = O.dequantize_loop(recipe, (m, k), full, rowwise=False)
    assert np.array_equal(q.dequantize(), row_deq, equal_nan=True)  # rowwise preferred
    q.update_usage(rowwise=False)
    assert not q.has_rowwise and q.rowwise_data is None and q.rowwise_scale_inv is None
    assert_same_buffers(buffers(q)[2:], full[2:])
    assert np.array_equal(q.dequantize(), col_deq, equal_nan=True)
    q.update_usage(columnwise=False)
    assert not q.has_columnwise and all(b is None for b in buffers(q))
    with pytest.raises(ValueError, match="neither"):
        q.dequantize()
    assert "none" in repr(q)


@pytest.mark.parametrize("recipe", [fb.Block1D(), fb.MXFP8()], ids=repr)
def test_update_usage_cannot_derive_other_direction(recipe, rng):
    x = O.random_input(rng, (64, 128), np.float32)
    q = fb.quantize(x, recipe)
    with pytest.raises(ValueError):
        q.update_usage(columnwise=True)
    q = fb.quantize(x, recipe, rowwise=False, columnwise=True)
    with pytest.raises(ValueError, match="rowwise=True"):
        q.update_usage(rowwise=True)
    assert q.has_columnwise and not q.has_rowwise  # unchanged after the error


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_block2d_update_usage_derives_either_direction(dtype, rng):
    x = O.random_input(rng, (300, 140), dtype)
    recipe = fb.Block2D(fb.E4M3, False, 1e-12)
    both = buffers(fb.quantize(x, recipe, rowwise=True, columnwise=True))
    q = fb.quantize(x, recipe)
    q.update_usage(columnwise=True)
    assert_same_buffers(buffers(q), both)
    q = fb.quantize(x, recipe, rowwise=False, columnwise=True)
    q.update_usage(rowwise=True)  # rowwise from columnwise, padding included
    assert_same_buffers(buffers(q), both)
    q = fb.quantize(x, recipe, rowwise=False, columnwise=True)
    q.update_usage(rowwise=True, columnwise=False)
    assert_same_buffers(buffers(q), (both[0], both[1], None, None))
    q = fb.quantize(x, recipe)
    q.update_usage(rowwise=False, columnwise=True)
    assert_same_buffers(buffers(q), (None, None, both[2], both[3]))


# --------------------------------------------------------------------------------------------
# dequantize, shapes, repr


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("out", [np.float32, BF16, np.float16, "bfloat16", "float32"],
                         ids=str)
def test_dequantize_dtypes(recipe, out, rng):
    x = O.random_input(rng, shape_for(recipe), np.float32)
    q = fb.quantize(x, recipe, columnwise=True)
    deq32 = O.dequantize_loop(recipe, x.shape, buffers(q), rowwise=True)
    with np.errstate(over="ignore"):  # fp16 output: values beyond 65504 become inf
        got = q.dequantize(out)
        again = fb.dequantize(q, out)
    want_dtype = BF16 if out == "bfloat16" else np.dtype(out)
    assert got.dtype == want_dtype and got.shape == x.shape
    with np.errstate(over="ignore", invalid="ignore"):
        want = deq32.astype(want_dtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))  # rounded once from fp32
    assert np.array_equal(again.view(np.uint8), got.view(np.uint8))


@pytest.mark.parametrize("bad", [np.float64, np.int32, np.uint8, "float8_e4m3fn"])
def test_dequantize_bad_dtype(bad, rng):
    q = fb.quantize(O.random_input(rng, (4, 64), np.float32), fb.Block1D())
    with pytest.raises(TypeError, match="dtype"):
        q.dequantize(bad)


def test_dequantize_rejects_non_blocktensor():
    with pytest.raises(TypeError, match="BlockTensor"):
        fb.dequantize(np.zeros((2, 2), np.float32))


@pytest.mark.parametrize("shape", [(3, 50, 130), (2, 2, 2, 64), (200,)], ids=str)
@pytest.mark.parametrize("recipe", [fb.Block1D(), fb.Block2D()], ids=repr)
def test_nd_and_1d_shapes(shape, recipe, rng):
    x = O.random_input(rng, shape, BF16)
    q = fb.quantize(x, recipe, columnwise=True)
    m = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    assert q.shape == shape and q.shape2d == (m, shape[-1])
    assert q.rowwise_data.shape == (m, shape[-1])
    assert_same_buffers(buffers(q), O.quantize_loop(x.reshape(m, shape[-1]), recipe, True, True))
    assert q.dequantize().shape == shape
    assert np.array_equal(q.dequantize().reshape(m, -1),
                          O.dequantize_loop(recipe, (m, shape[-1]), buffers(q), True),
                          equal_nan=True)


def test_blocktensor_attributes_and_repr(rng):
    q = fb.quantize(O.random_input(rng, (2, 64, 96), np.float16), fb.MXFP8(), columnwise=True)
    assert isinstance(q, fb.BlockTensor)
    assert q.recipe == fb.MXFP8() and q.shape == (2, 64, 96) and q.dtype == np.float16
    assert q.has_rowwise and q.has_columnwise
    r = repr(q)
    assert "MXFP8" in r and "rowwise+columnwise" in r and "(2, 64, 96)" in r
