"""GPU ``dequantize``: ``fl32(decode(byte) * scale_inv)`` rounded once to fp32/bf16/fp16, from
rowwise buffers if given, else columnwise ones (same contract as the reference).

One element-wise kernel specialized per (recipe, direction, format, output dtype). Thread
(x, y) of the 2-D grid handles output element (m, k); for the transposed columnwise sources
(Block1D, Block2D, data (K, M)) x runs along M so the byte reads are coalesced, otherwise along
K. FP8 decoding is bit arithmetic (exact). A NaN result is written as the quiet NaN NumPy
produces (0x7FC00000, bf16 0x7FC0, fp16 0x7E00), not the GPU's canonical 0x7FFFFFFF.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .._arrays import BF16
from ..formats import Block1D, Block2D, E4M3, MXFP8
from ._host import i64, module_of, pointer_arg
from ._numba import (bits_f32, compile_kernel, cuda, device, f32_bf16_bits, f32_f16_bits,
                     ptr, types)

BX, BY = 32, 8
_OUT = {np.dtype(np.float32): 0, BF16: 1, np.dtype(np.float16): 2}


@lru_cache(maxsize=None)
def fp8_decoder(e4m3):
    """``decode(byte) -> float32`` (exact; E4M3 0x7F/0xFF and E5M2 exponent-31 codes with a
    non-zero mantissa are NaN, E5M2 0x7C/0xFC are +-inf)."""
    MB = 3 if e4m3 else 2
    BIAS = 7 if e4m3 else 15
    EMAX = (1 << (7 - MB)) - 1
    SUB = np.float32(2.0 ** (1 - BIAS - MB))
    NAN = np.float32(np.nan)
    INF = np.float32(np.inf)

    @device
    def decode(b):
        b = int(b)
        sign = (b >> 7) & 1
        e = (b >> MB) & EMAX
        m = b & ((1 << MB) - 1)
        if e == 0:
            v = np.float32(m) * SUB
        elif e == EMAX and (e4m3 and m == (1 << MB) - 1):
            v = NAN
        elif e == EMAX and not e4m3:
            v = INF if m == 0 else NAN
        else:
            v = bits_f32(((e - BIAS + 127) << 23) | (m << (23 - MB)))
        if sign:
            v = -v
        return v
    return decode


@lru_cache(maxsize=None)
def e8m0_decoder():
    """``2**(c-127)`` for E8M0 code c; 0 -> 2**-127, 255 -> NaN."""
    NAN = np.float32(np.nan)
    TINY = np.float32(2.0 ** -127)

    @device
    def decode(c):
        c = int(c)
        if c == 255:
            return NAN
        if c == 0:
            return TINY
        return bits_f32(c << 23)
    return decode


def make_kernel_pyfunc(recipe_kind, columnwise, e4m3, out_kind):
    decode = fp8_decoder(e4m3)
    e8m0 = e8m0_decoder()
    TRANSPOSED = columnwise and recipe_kind != "mxfp8"
    QNAN = np.float32(np.nan)

    def kernel(data, sinv, out, M, K, ld_sinv):
        a = cuda.blockIdx.x * BX + cuda.threadIdx.x
        b = cuda.blockIdx.y * BY + cuda.threadIdx.y
        if TRANSPOSED:
            m, k = a, b
        else:
            m, k = b, a
        if m >= M or k >= K:
            return
        if TRANSPOSED:
            v = decode(data[k * M + m])
        else:
            v = decode(data[m * K + k])
        if recipe_kind == "block1d":
            if columnwise:
                f = sinv[(m // 128) * ld_sinv + k]
            else:
                f = sinv[(k // 128) * ld_sinv + m]
        elif recipe_kind == "block2d":
            if columnwise:
                f = sinv[(k // 128) * ld_sinv + m // 128]
            else:
                f = sinv[(m // 128) * ld_sinv + k // 128]
        else:
            if columnwise:
                f = e8m0(sinv[(m // 32) * ld_sinv + k])
            else:
                f = e8m0(sinv[m * ld_sinv + k // 32])
        y = v * f
        if y != y:
            y = QNAN
        if out_kind == 0:
            out[m * K + k] = y
        elif out_kind == 1:
            out[m * K + k] = f32_bf16_bits(y)
        else:
            out[m * K + k] = f32_f16_bits(y)

    return kernel


def argtypes(recipe_kind, out_kind):
    sinv_t = types.uint8 if recipe_kind == "mxfp8" else types.float32
    out_t = types.float32 if out_kind == 0 else types.uint16
    return (ptr(types.uint8), ptr(sinv_t), ptr(out_t), types.int64, types.int64, types.int64)


@lru_cache(maxsize=None)
def get_kernel(recipe_kind, columnwise, e4m3, out_kind):
    return compile_kernel(make_kernel_pyfunc(recipe_kind, columnwise, e4m3, out_kind),
                          argtypes(recipe_kind, out_kind), launch_bounds=BX * BY)


_KIND = {Block1D: "block1d", Block2D: "block2d", MXFP8: "mxfp8"}


def dequantize(recipe, shape2d, rowwise_data=None, rowwise_scale_inv=None,
               columnwise_data=None, columnwise_scale_inv=None, dtype=np.float32):
    """(M, K) device array of `dtype` (bf16 returned as uint16 bit patterns) from rowwise
    buffers if given, else columnwise ones."""
    rows, cols = shape2d
    if rowwise_data is not None:
        data, sinv, columnwise = rowwise_data, rowwise_scale_inv, False
    elif columnwise_data is not None:
        data, sinv, columnwise = columnwise_data, columnwise_scale_inv, True
    else:
        raise ValueError("nothing to dequantize: the tensor holds neither rowwise nor "
                         "columnwise data")
    out_dtype = np.dtype(dtype)
    if out_dtype not in _OUT:
        raise TypeError(f"dequantize dtype must be float32, bfloat16 or float16, got {dtype}")
    out_kind = _OUT[out_dtype]
    xp = module_of(data)
    holder = np.float32 if out_kind == 0 else np.uint16
    out = xp.empty((rows, cols), dtype=holder)
    if rows and cols:
        rk = _KIND[type(recipe)]
        kernel = get_kernel(rk, columnwise, recipe.fmt is E4M3, out_kind)
        along = rows if (columnwise and rk != "mxfp8") else cols
        across = cols if (columnwise and rk != "mxfp8") else rows
        grid = (-(-along // BX), -(-across // BY), 1)
        args = (pointer_arg(data, np.uint8), pointer_arg(sinv, sinv.dtype),
                pointer_arg(out, holder), i64(rows), i64(cols), i64(sinv.shape[1]))
        kernel(grid, (BX, BY, 1), args)
    if out_kind == 2:
        return out.view(np.float16)
    if out_kind == 1 and xp is np:
        return out.view(BF16)
    return out
