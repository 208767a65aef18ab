"""Independent, deliberately simple oracles for fp8blk's numerics (docs/numerics.md and docs/layouts.md).

These are written from the specification, not from ``fp8blk.reference``: they import nothing of
fp8blk but the recipe classes (plain data), use Python floats, ``struct`` bit patterns and loops
over blocks, and encode FP8 by searching the table of the 256 decoded codes. The loops make
them slow (a few microseconds per block): keep shapes modest.

Public helpers (other test modules may import them):

* ``f32(x)``, ``f32_bits(x)``, ``bits_f32(b)``           fp32 rounding and bit patterns
* ``fp8_code_values(fmt)``                              float64 value of each of the 256 codes
* ``nearest_fp8_code(values_fp32, fmt)``               the FP8 cast (vectorized table search)
* ``fp8_half_ulp(values, fmt)``                         half the FP8 spacing at |value|
* ``block_amax(values)``                               TE's fmaxf-from-0 amax of one block
* ``fp32_scale(amax, fmt, pow2, eps, value_for_inf)``  docs/numerics.md steps 1-5, scalar
* ``scale_inv(scale)``, ``dtype_max(dtype)``
* ``e8m0_code(amax, fmt)``, ``e8m0_multiplier(code)``, ``e8m0_value(code)``
* ``block_shape(recipe, rowwise)``, ``block_scales(x2d, recipe, rowwise)``  per-block loop
* ``quantize_loop(x2d, recipe, rowwise, columnwise)``  the four buffers of docs/layouts.md
* ``block_factors(recipe, shape2d, scale_inv, rowwise)``, ``dequantize_loop(...)``
* ``random_input(rng, shape, dtype, specials)``        test data with special blocks
* ``tiny_value(dtype)``                                a subnormal of the dtype
"""
from __future__ import annotations

import math
import struct
from functools import lru_cache

import ml_dtypes
import numpy as np

from fp8blk.formats import Block1D, Block2D, MXFP8


# --------------------------------------------------------------------------------------------
# fp32 helpers


def f32(x) -> float:
    """``x`` rounded to fp32 (round to nearest even, overflow to inf), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def f32_bits(x) -> int:
    """The 32-bit pattern of an fp32 value (``x`` must already be representable in fp32)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


FLT_MAX = bits_f32(0x7F7FFFFF)
BF16_MAX = bits_f32(0x7F7F0000)  # bf16 is the top half of an fp32 pattern
FP16_MAX = 65504.0


def dtype_max(dtype) -> float:
    """Largest finite value of fp32 / bf16 / fp16 (docs/numerics.md step 4 in ``quantize``)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return FLT_MAX
    if dtype == np.dtype(ml_dtypes.bfloat16):
        return BF16_MAX
    if dtype == np.float16:
        return FP16_MAX
    raise TypeError(dtype)


# --------------------------------------------------------------------------------------------
# FP8 formats from their definitions (OCP FP8: E4M3 "fn" has no inf and one NaN mantissa;
# E5M2 is IEEE-like with inf and NaNs)

_SPEC = {  # name: (exponent bits, mantissa bits, bias)
    "E4M3": (4, 3, 7),
    "E5M2": (5, 2, 15),
}


def fmt_max(fmt) -> float:
    return {"E4M3": 448.0, "E5M2": 57344.0}[fmt.name]


@lru_cache(maxsize=None)
def fp8_code_values(fmt) -> np.ndarray:
    """float64 value of each code 0..255, computed one code at a time from sign, exponent and
    mantissa fields. NaN codes give NaN, E5M2's inf codes give +-inf."""
    ebits, mbits, bias = _SPEC[fmt.name]
    out = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> mbits) & ((1 << ebits) - 1)
        mantissa = code & ((1 << mbits) - 1)
        top = exponent == (1 << ebits) - 1
        if fmt.name == "E4M3" and top and mantissa == (1 << mbits) - 1:
            value = math.nan
        elif fmt.name == "E5M2" and top:
            value = sign * math.inf if mantissa == 0 else math.nan
        elif exponent == 0:
            value = sign * math.ldexp(mantissa, 1 - bias - mbits)
        else:
            value = sign * math.ldexp((1 << mbits) + mantissa, exponent - bias - mbits)
        out[code] = value
    out.setflags(write=False)
    return out


@lru_cache(maxsize=None)
def _positive_finite(fmt):
    """(values, codes) of the non-negative finite codes 0x00..., ascending."""
    values = fp8_code_values(fmt)
    codes = [c for c in range(128) if math.isfinite(values[c])]
    vals = values[codes]
    assert np.all(np.diff(vals) > 0)
    return vals, np.asarray(codes, dtype=np.uint8)


def nearest_fp8_code(values_fp32, fmt) -> np.ndarray:
    """The FP8 cast of docs/numerics.md on fp32 values: the nearest finite code (ties to the even
    code), saturating at +-max (so +-inf give +-max), NaN -> 0x7F, sign of zero kept.

    Vectorized by a binary search in the ascending table of non-negative finite codes; the
    midpoint comparison ``2|v|`` vs ``lo + hi`` is exact in float64.
    """
    v = np.asarray(values_fp32, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        magnitude = np.abs(v).astype(np.float64)
    vals, codes = _positive_finite(fmt)
    clipped = np.minimum(magnitude, vals[-1])
    clipped = np.where(np.isnan(clipped), 0.0, clipped)
    hi = np.clip(np.searchsorted(vals, clipped, side="left"), 0, len(vals) - 1)
    lo = np.maximum(hi - 1, 0)
    lo_code, hi_code = codes[lo], codes[hi]
    twice, midpoint_twice = 2 * clipped, vals[lo] + vals[hi]
    even = np.where(lo_code % 2 == 0, lo_code, hi_code)
    pick = np.where(twice < midpoint_twice, lo_code,
                    np.where(twice > midpoint_twice, hi_code, even))
    pick = np.where(vals[hi] == clipped, hi_code, pick)
    pick = pick | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(v), np.uint8(0x7F), pick).astype(np.uint8)


def fp8_half_ulp(magnitude, fmt) -> np.ndarray:
    """Half the spacing of FP8 values at |y| (|y| clamped to max): 2**(max(e, emin) - m - 1),
    e = floor(log2 |y|); in the subnormal range that is half the subnormal step."""
    ebits, mbits, bias = _SPEC[fmt.name]
    y = np.minimum(np.abs(np.asarray(magnitude, dtype=np.float64)), fmt_max(fmt))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(y > 0, y, 1.0)))
    e = np.maximum(e, 1 - bias)
    return np.ldexp(1.0, (e - mbits - 1).astype(np.int64))


# --------------------------------------------------------------------------------------------
# Scale rules, one amax at a time


def block_amax(values) -> float:
    """max |x| over a block, ignoring NaN, starting from 0 (TE's fmaxf reduction): an all-NaN
    block gives 0."""
    a = np.abs(np.asarray(values, dtype=np.float64).ravel())
    a = a[~np.isnan(a)]
    return float(a.max()) if a.size else 0.0


def fp32_scale(amax: float, fmt, pow2: bool, eps: float, value_for_inf: float) -> float:
    """docs/numerics.md steps 1-5 for one amax, as an fp32 value held in a Python float."""
    a = f32(amax)
    eps32 = f32(eps)
    if a < eps32:  # a NaN amax compares False here and is caught below
        a = eps32
    if a == 0 or math.isinf(a) or math.isnan(a):
        scale = 1.0
    else:
        # fl32(F / a): IEEE fp32 division (np.float32 operands), correctly rounded.
        with np.errstate(over="ignore", divide="ignore"):
            scale = float(np.float32(fmt_max(fmt)) / np.float32(a))
        if math.isinf(scale):
            scale = f32(value_for_inf)
    if pow2:
        scale = bits_f32(f32_bits(scale) & 0xFF800000)
    return scale


def scale_inv(scale: float) -> float:
    """fl32(1 / scale)."""
    with np.errstate(divide="ignore", over="ignore"):
        return float(np.float32(1.0) / np.float32(scale))


def e8m0_code(amax: float, fmt) -> int:
    """docs/numerics.md's E8M0 rule: v = fl32(a * fl32(1/F)); NaN -> 255, inf -> 254, 0 -> 0;
    v <= 2**-127 -> 0; else the biased exponent of v, rounded up when v is not a power of two,
    never beyond 254."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = float(np.float32(amax) * (np.float32(1.0) / np.float32(fmt_max(fmt))))
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    if v <= 2.0 ** -127:
        return 0
    mantissa, exponent = math.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    biased = exponent - 1 + 127          # biased exponent of v when v is a power of two
    if mantissa != 0.5:                  # not a power of two: round the exponent up
        biased += 1
    if v < 2.0 ** -126:                  # fp32 subnormal above 2**-127: one step above 0
        biased = 1
    return min(biased, 254)


def e8m0_multiplier(code: int) -> float:
    """fp32 factor applied before the cast for an E8M0 code, as TransformerEngine's
    ``exp2f_rcp`` (transformer_engine/common/util/ptx.cuh, 2.13 and later) computes it:
    0..253 -> 2**(127 - c) (so 0 -> 2**127), 254 -> 2**-127 (an fp32 subnormal), 255 -> NaN.
    (Code 254 only arises for an inf amax.)"""
    if code == 255:
        return math.nan
    return math.ldexp(1.0, 127 - code)


def e8m0_value(code: int) -> float:
    """Decoded E8M0 scale: 2**(c - 127), code 255 is NaN."""
    return math.nan if code == 255 else math.ldexp(1.0, code - 127)


# --------------------------------------------------------------------------------------------
# quantize / dequantize by loops over blocks


def _cdiv(a, b):
    return -(-a // b)


def _round(a, b):
    return _cdiv(a, b) * b


def _cast(x64, multiplier64, fmt):
    """FP8 codes of fl32(x * multiplier): the float64 product of two fp32 values is exact,
    so rounding it to fp32 once is the fp32 multiply."""
    with np.errstate(over="ignore", invalid="ignore"):
        return nearest_fp8_code((x64 * multiplier64).astype(np.float32), fmt)


def block_shape(recipe, rowwise: bool):
    """(rows, cols) of one block in (M, K) coordinates for a recipe and direction."""
    if isinstance(recipe, Block2D):
        return (128, 128)
    size = 128 if isinstance(recipe, Block1D) else 32
    return (1, size) if rowwise else (size, 1)


def block_scales(x2d, recipe, rowwise: bool):
    """Loop over the blocks of an (M, K) array (edge blocks partial).

    Returns ``(per_block, multiplier)``: per_block is (cdiv(M,br), cdiv(K,bc)) holding the fp32
    scale (Block1D/Block2D) or the E8M0 code (MXFP8) of each block; multiplier is float64
    (M, K) holding each element's cast multiplier (the scale, or the E8M0 cast multiplier).
    """
    x = np.asarray(x2d)
    rows, cols = x.shape
    x64 = x.astype(np.float64)  # exact widening
    br, bc = block_shape(recipe, rowwise)
    per_block = np.zeros((_cdiv(rows, br), _cdiv(cols, bc)))
    multiplier = np.empty((rows, cols))
    for i in range(per_block.shape[0]):
        for j in range(per_block.shape[1]):
            sl = (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            amax = block_amax(x64[sl])
            if isinstance(recipe, MXFP8):
                code = e8m0_code(amax, recipe.fmt)
                per_block[i, j], multiplier[sl] = code, e8m0_multiplier(code)
            else:
                scale = fp32_scale(amax, recipe.fmt, recipe.pow2_scales, recipe.amax_epsilon,
                                   dtype_max(x.dtype))
                per_block[i, j], multiplier[sl] = scale, scale
    return per_block, multiplier


def quantize_loop(x2d, recipe, rowwise: bool = True, columnwise: bool = False):
    """(row_data, row_scale_inv, col_data, col_scale_inv) of an (M, K) fp32/bf16/fp16 array,
    None for a direction not asked for, in the layouts of docs/layouts.md with padding 1.0 (fp32) or
    0 (E8M0), each scale written at its index by a loop."""
    x = np.asarray(x2d)
    rows, cols = x.shape
    x64 = x.astype(np.float64)
    fmt = recipe.fmt
    out = [None, None, None, None]
    if isinstance(recipe, MXFP8):
        assert rows % 32 == 0 and cols % 32 == 0
    for rowwise_dir, wanted in ((True, rowwise), (False, columnwise)):
        if not wanted:
            continue
        per_block, multiplier = block_scales(x, recipe, rowwise_dir)
        codes = _cast(x64, multiplier, fmt)  # (M, K)
        nbr, nbc = per_block.shape
        if isinstance(recipe, Block1D) and rowwise_dir:      # blocks [m, kb] -> sinv[kb, m]
            data, sinv = codes, np.ones((_cdiv(cols, 128), _round(rows, 4)), np.float32)
            for m in range(nbr):
                for kb in range(nbc):
                    sinv[kb, m] = scale_inv(per_block[m, kb])
        elif isinstance(recipe, Block1D):                    # blocks [mb, k] -> sinv[mb, k]
            data, sinv = codes.T, np.ones((_cdiv(rows, 128), _round(cols, 4)), np.float32)
            for mb in range(nbr):
                for k in range(nbc):
                    sinv[mb, k] = scale_inv(per_block[mb, k])
        elif isinstance(recipe, Block2D) and rowwise_dir:    # tiles [mt, kt] -> sinv[mt, kt]
            data, sinv = codes, np.ones((nbr, _round(nbc, 4)), np.float32)
            for mt in range(nbr):
                for kt in range(nbc):
                    sinv[mt, kt] = scale_inv(per_block[mt, kt])
        elif isinstance(recipe, Block2D):                    # tiles [mt, kt] -> sinv[kt, mt]
            data, sinv = codes.T, np.ones((nbc, _round(nbr, 4)), np.float32)
            for mt in range(nbr):
                for kt in range(nbc):
                    sinv[kt, mt] = scale_inv(per_block[mt, kt])
        elif rowwise_dir:                                    # MXFP8 [m, kb] -> sinv[m, kb]
            data, sinv = codes, np.zeros((_round(rows, 128), _round(cols // 32, 4)), np.uint8)
            sinv[:nbr, :nbc] = per_block
        else:                                                # MXFP8 [mb, k] -> sinv[mb, k]
            data, sinv = codes, np.zeros((_round(rows // 32, 4), _round(cols, 128)), np.uint8)
            sinv[:nbr, :nbc] = per_block
        slot = 0 if rowwise_dir else 2
        out[slot], out[slot + 1] = np.ascontiguousarray(data), sinv
    return tuple(out)


def block_factors(recipe, shape2d, scale_inv_buffer, rowwise: bool) -> np.ndarray:
    """float64 (M, K): each element's dequantization factor read from a (padded) scale_inv
    buffer at the index docs/layouts.md gives for its block (fp32 value, or decoded E8M0 code)."""
    rows, cols = shape2d
    sinv = np.asarray(scale_inv_buffer)
    m = np.arange(rows)[:, None]
    k = np.arange(cols)[None, :]
    if isinstance(recipe, Block1D):
        idx = (k // 128, m) if rowwise else (m // 128, k)
    elif isinstance(recipe, Block2D):
        idx = (m // 128, k // 128) if rowwise else (k // 128, m // 128)
    else:
        idx = (m, k // 32) if rowwise else (m // 32, k)
    idx = np.broadcast_arrays(*idx)
    picked = sinv[idx[0], idx[1]]
    if isinstance(recipe, MXFP8):
        table = np.array([e8m0_value(c) for c in range(256)])
        return table[picked]
    return picked.astype(np.float64)


def dequantize_loop(recipe, shape2d, buffers, rowwise: bool) -> np.ndarray:
    """fp32 (M, K): fl32(decode(byte) * factor) from the rowwise or the columnwise buffers
    (Block1D/Block2D columnwise data is (K, M); MXFP8 columnwise data is (M, K))."""
    row_data, row_sinv, col_data, col_sinv = buffers
    if rowwise:
        data, sinv = np.asarray(row_data), row_sinv
    else:
        data = np.asarray(col_data)
        data = data if isinstance(recipe, MXFP8) else data.T
        sinv = col_sinv
    values = fp8_code_values(recipe.fmt)[data]
    factor = block_factors(recipe, shape2d, sinv, rowwise)
    with np.errstate(invalid="ignore", over="ignore"):
        return (values * factor).astype(np.float32)  # float64 product exact: 4 x 24 bits


# --------------------------------------------------------------------------------------------
# test data


def tiny_value(dtype) -> float:
    """A subnormal of the dtype (fp32 and bf16: below F / FLT_MAX, so F / amax overflows)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return 2.0 ** -20
    return 2.0 ** -130


def random_input(rng, shape, dtype, specials: bool = True) -> np.ndarray:
    """Random (..., K) array of `dtype` whose rows and columns span many binades, so blocks get
    different scales. With `specials`, each of these lands (with probability 1/2) in a random
    rectangle aligned to 32 elements: zeros (and -0), all NaN, single NaN / +-inf, the dtype's
    max (+-), subnormals of the dtype, values below F/FLT_MAX (the value_for_inf path), and a
    block mixing magnitudes 2**-40..2**40 (clipped to the dtype).
    """
    dtype = np.dtype(dtype)
    m = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    k = shape[-1]
    span = 8 if dtype == np.float16 else 30
    x = rng.standard_normal((m, k))
    x *= np.exp2(rng.uniform(-span, span, size=(m, 1)))
    x *= np.exp2(rng.uniform(-4, 4, size=(1, k)))
    if specials and m * k:
        big, tiny = dtype_max(dtype), tiny_value(dtype)

        def rect():
            r0 = int(rng.integers(0, max(1, m // 32 + 1))) * 32 % max(m, 1)
            c0 = int(rng.integers(0, max(1, k // 32 + 1))) * 32 % max(k, 1)
            h = int(rng.choice([1, 32, 64, 128, 160]))
            w = int(rng.choice([1, 32, 64, 128, 160]))
            return slice(r0, r0 + h), slice(c0, c0 + w)

        def point():
            return int(rng.integers(0, m)), int(rng.integers(0, k))

        def fill(make):
            sl = rect()
            x[sl] = make(x[sl].shape)

        kinds = [
            lambda: fill(lambda sh: np.zeros(sh)),
            lambda: fill(lambda sh: np.full(sh, -0.0)),
            lambda: fill(lambda sh: np.full(sh, np.nan)),                        # all-NaN
            lambda: x.__setitem__(point(), np.nan),
            lambda: x.__setitem__(point(), np.inf),
            lambda: x.__setitem__(point(), -np.inf),
            lambda: x.__setitem__(point(), big * rng.choice([-1.0, 1.0])),
            lambda: fill(lambda sh: tiny * rng.integers(-8, 9, size=sh)),        # subnormal
            lambda: fill(lambda sh: 1e-37 * rng.standard_normal(sh)),            # F/amax = inf
            lambda: fill(lambda sh: rng.standard_normal(sh)
                         * np.exp2(rng.integers(-40, 41, size=sh))),             # mixed
        ]
        for apply in kinds:
            if rng.random() < 0.5:
                apply()
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if dtype == np.float16:
            x = np.clip(x, -FP16_MAX, FP16_MAX)
        out = x.astype(np.float32).astype(dtype)
    return out.reshape(shape)
