"""Scale rules shared by the reference, the kernels' host side and the master-weight path.

All functions take and return NumPy arrays and are exact in fp32 (docs/numerics.md):

fp32-scale recipes (Block1D, Block2D), from block amax ``a``, format max ``F``, epsilon ``eps``:
  1. ``a < eps`` -> ``a = eps``;
  2. ``a`` is 0, inf or NaN -> scale 1;
  3. else ``scale = fl32(F / a)``;
  4. ``scale`` is inf -> ``value_for_inf`` (the input dtype's max in quantize, FLT_MAX in the
     master-weight path);
  5. ``pow2_scales`` -> keep sign and exponent bits only (``bits & 0xFF800000``).
``scale_inv = fl32(1 / scale)``.

E8M0 (MXFP8): see :func:`e8m0_from_amax`, :func:`e8m0_cast_multiplier`, :func:`e8m0_decode`.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import Format

FLT_MAX = float(np.finfo(np.float32).max)

_DTYPE_MAX = {
    np.dtype(np.float32): FLT_MAX,
    np.dtype(ml_dtypes.bfloat16): float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
    np.dtype(np.float16): float(np.finfo(np.float16).max),
}


def dtype_max(dtype) -> float:
    """Largest finite value of a supported high-precision dtype (the scale used when F/amax
    overflows in ``quantize``)."""
    return _DTYPE_MAX[np.dtype(dtype)]


def fp32_scale_from_amax(amax, fmt: Format, pow2_scales: bool, amax_epsilon: float,
                         value_for_inf: float) -> np.ndarray:
    """fp32 scale (the multiplier applied before the FP8 cast) for each amax. Any shape."""
    a = np.asarray(amax, dtype=np.float32)
    eps = np.float32(amax_epsilon)
    if eps > 0:
        a = np.where(a < eps, eps, a)
    bad = (a == 0) | ~np.isfinite(a)
    with np.errstate(all="ignore"):
        scale = np.float32(fmt.max) / np.where(bad, np.float32(1), a)
    scale = np.where(np.isinf(scale), np.float32(value_for_inf), scale).astype(np.float32)
    scale = np.where(bad, np.float32(1), scale).astype(np.float32)
    if pow2_scales:
        scale = (scale.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return scale


def scale_inv_from_scale(scale) -> np.ndarray:
    """``fl32(1 / scale)``, the factor stored beside the data for dequantization."""
    with np.errstate(divide="ignore"):
        return (np.float32(1) / np.asarray(scale, dtype=np.float32)).astype(np.float32)


def e8m0_from_amax(amax, fmt: Format) -> np.ndarray:
    """E8M0 code (uint8) for each block amax, rounding the exponent up (TE's float_to_e8m0).

    ``v = fl32(a * fl32(1/F))``; NaN -> 255, inf -> 254, 0 -> 0; else the biased exponent of v,
    plus one when its mantissa is non-zero, where a subnormal v <= 2**-127 stays 0 and 254
    never rounds up to 255. Codes are monotone in amax, so the max of codes is the code of the
    max (what the master-weight path all-reduces).
    """
    a = np.asarray(amax, dtype=np.float32)
    with np.errstate(all="ignore"):
        v = (a * (np.float32(1) / np.float32(fmt.max))).astype(np.float32)
    bits = v.view(np.uint32)
    exponent = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32)
    mantissa = bits & np.uint32(0x7FFFFF)
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + round_up.astype(np.int32)
    code = np.where(np.isinf(v), 254, code)
    code = np.where(np.isnan(v), 255, code)
    code = np.where(v == 0, 0, code)
    return code.astype(np.uint8)


def e8m0_cast_multiplier(code) -> np.ndarray:
    """fp32 factor applied before the FP8 cast for E8M0 code ``c``: ``2**(127 - c)``.

    Written as TransformerEngine's ``exp2f_rcp`` (2.13 and later) does: the bit pattern
    ``(254 - c) << 23``, so code 0 gives 2**127; code 254 gives 2**-127 (the fp32 subnormal
    0x00400000) and code 255 gives NaN (0x7FFFFFFF). Code 0 only arises for amax <= ~F * 2**-127,
    code 254 only for an inf amax and 255 never from ``quantize`` (amaxes are never NaN).
    """
    c = np.asarray(code, dtype=np.uint8).astype(np.int32)
    bits = ((254 - c) << 23).astype(np.uint32)
    bits = np.where(c == 254, np.uint32(0x00400000), bits)
    bits = np.where(c == 255, np.uint32(0x7FFFFFFF), bits).astype(np.uint32)
    return bits.view(np.float32)


def e8m0_decode(code) -> np.ndarray:
    """fp32 value of an E8M0 scale for dequantization: ``2**(c - 127)``, as TransformerEngine's
    ``exp2f`` (2.20.2): code 0 gives 2**-127 (the fp32 subnormal 0x00400000), 255 gives NaN."""
    c = np.asarray(code, dtype=np.uint8).astype(np.int32)
    exp = np.where(c == 0, 0, c).astype(np.uint32)
    value = (exp << np.uint32(23)).view(np.float32)
    value = np.where(c == 0, np.float32(2.0 ** -127), value)
    return np.where(c == 255, np.float32(np.nan), value).astype(np.float32)
