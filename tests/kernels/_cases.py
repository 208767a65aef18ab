"""Shared test data for the kernel tests (simulator and GPU): random inputs that contain the
special values the kernels must get right (the byte-for-byte comparison: tests/_same.py)."""
import ml_dtypes
import numpy as np

import fp8blk as fb

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16, "f16": np.dtype(np.float16)}


def make_input(rng, shape, dtype, specials=True):
    """Random (…, K) array of `dtype` with magnitudes over many binades, plus (when
    `specials`) NaN, -NaN, +-inf, a zero 128x128 region, an all-NaN 1x32 run, the dtype's max,
    subnormal-range values, a tiny-amax row, a row of MXFP8 code-0 blocks (amax <= ~F * 2**-127)
    and a block holding +-inf beside the dtype's max (MXFP8 code 254: finite bytes non-zero)."""
    dtype = np.dtype(dtype)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp2(rng.integers(-8, 9, size=shape)).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    m, k = flat.shape
    if specials and m and k:
        n = flat.size
        idx = rng.choice(n, size=min(n, 24), replace=False)
        vals = [np.nan, -np.nan, np.inf, -np.inf]
        for i, j in enumerate(idx[:16]):
            flat.flat[j] = vals[i % 4]
        if m >= 256 and k >= 256:
            flat[128:256, 128:256] = 0.0            # a zero 128x128 tile
        flat[m - 1, :] = 0.0                        # zero row blocks
        flat[:, k - 1] = 0.0                        # zero column blocks
        if m > 2:
            flat[1, : min(k, 32)] = np.nan          # an all-NaN 1x32 block
        if m > 3:
            flat[2, :] *= np.float32(2.0 ** -120)   # tiny amax (scale overflow path)
        big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) if dtype == BF16 else \
            float(np.finfo(dtype).max)
        if m > 4:
            flat[3, : min(k, 7)] = big * np.array([1, -1, 1, 0.5, -1, 1, 1][: min(k, 7)])
        if m > 5:
            flat[4, :] *= np.float32(2.0 ** -135)   # MXFP8 E8M0 code 0, fp32 subnormals
        if m > 6:                                   # MXFP8 code 254: +-inf beside huge values
            flat[5, : min(k, 6)] = np.array([np.inf, big, -big, 0.5 * big, -np.inf, -0.25 * big]
                                            )[: min(k, 6)]
    with np.errstate(over="ignore"):
        return x.astype(dtype)


RECIPES = {
    "b1d": fb.Block1D(),
    "b1d-e5m2-nopow2": fb.Block1D(fmt=fb.E5M2, pow2_scales=False),
    "b1d-eps": fb.Block1D(pow2_scales=False, amax_epsilon=1e-3),
    "b2d": fb.Block2D(),
    "b2d-e5m2-nopow2": fb.Block2D(fmt=fb.E5M2, pow2_scales=False),
    "mx": fb.MXFP8(),
    "mx-e5m2": fb.MXFP8(fmt=fb.E5M2),
}


def plant_fp8_specials(rng, bufs, recipe):
    """Copies of quantize's (row_data, row_sinv, col_data, col_sinv) (None stays None) holding
    what quantize never writes but dequantize must decode: a run of all 256 FP8 codes in random
    order inside each data buffer (E5M2 +-inf, -NaN 0xFF, -0, subnormals), and for MXFP8 the
    E8M0 codes 0 (2**-127: subnormal results), 1, 254 (2**127: overflow to inf) and 255 (NaN)
    at random scale entries of the valid region. fp32 scale_inv entries are left alone (a zero
    or infinite one makes inf * 0, whose NaN sign the reference takes from the host CPU)."""
    out = [None if b is None else np.array(b, copy=True) for b in bufs]
    for d in (0, 2):
        data, sinv = out[d], out[d + 1]
        if data is None or data.size == 0:
            continue
        flat = data.reshape(-1)
        n = min(flat.size, 256)
        start = int(rng.integers(0, flat.size - n + 1))
        flat[start:start + n] = rng.permutation(256)[:n].astype(np.uint8)
        if isinstance(recipe, fb.MXFP8):
            rows, cols = data.shape
            valid = (rows, cols // 32) if d == 0 else (rows // 32, cols)
            for code in (0, 0, 1, 254, 255, 255):
                sinv[int(rng.integers(valid[0])), int(rng.integers(valid[1]))] = code
    return out
