"""NumPy oracle for every kernel, and the CPU execution path.

Everything here is exact to the byte (docs/numerics.md, docs/layouts.md) and vectorized: no Python loop runs over
elements or blocks. Arrays are NumPy; high-precision inputs are float32, float16 or
ml_dtypes.bfloat16 and are widened to float32 exactly before any arithmetic. FP8 bytes are uint8.

Conventions used throughout:
  * a 2-D input is (M, K); larger inputs are viewed as (M, K) by the caller;
  * ``cdiv`` is ceiling division, ``round4`` / ``round128`` round up to a multiple;
  * a block amax is TE's ``fmaxf`` reduction started at 0: NaN is ignored, so a block whose
    elements are all NaN has amax 0 (scale 1, E8M0 code 0), and amaxes are never NaN. Partial
    amaxes give 0 for blocks a shard does not touch, so a plain max over shards is exact.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import scaling
from .formats import Block1D, Block2D, Format, MXFP8
from .layout import cdiv, round_up


# --------------------------------------------------------------------------------------------
# FP8 encoding and decoding


def encode_fp8(values, fmt: Format) -> np.ndarray:
    """Round fp32 values to the nearest FP8 code, ties to even, saturating to +-max.

    +-inf become +-max, NaN becomes the canonical NaN byte 0x7F, the sign of zero is kept.
    Returns uint8 of the same shape.
    """
    v = np.ascontiguousarray(values, dtype=np.float32)
    mbits = fmt.mantissa_bits
    shift = np.uint32(23 - mbits)
    magnitude = np.abs(v)
    np.minimum(magnitude, np.float32(fmt.max), out=magnitude)  # NaN stays NaN
    mag_bits = magnitude.view(np.uint32)
    # Normal results: round the fp32 significand to `mbits` bits on the bit pattern (RNE: add
    # half an ulp minus one, plus the lowest kept bit); a carry into the exponent is the right
    # result. Then rebias the exponent from fp32's 127 to the format's bias.
    code = mag_bits >> shift
    code &= np.uint32(1)
    code += np.uint32((1 << (23 - mbits - 1)) - 1)
    code += mag_bits
    code >>= shift
    code -= np.uint32((127 - fmt.exponent_bias) << mbits)
    # Subnormal results: adding 2**(emin - mbits + 23) makes fp32's ulp equal the subnormal
    # step, so the hardware addition rounds to even for us; the bits above that constant's bits
    # are the code (2**mbits steps is the min normal, also correct).
    magic = np.float32(2.0 ** (fmt.min_normal_exponent - mbits + 23))
    with np.errstate(invalid="ignore"):  # signalling-NaN inputs; their code is set below
        subnormal = magnitude + magic
    subnormal_bits = subnormal.view(np.uint32)
    subnormal_bits -= magic.view(np.uint32)
    np.copyto(code, subnormal_bits, where=magnitude < np.float32(2.0 ** fmt.min_normal_exponent))
    code |= (v.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)
    np.copyto(code, np.uint32(fmt.nan_code), where=np.isnan(v))
    return code.astype(np.uint8)


@lru_cache(maxsize=None)
def fp8_decode_table(fmt: Format) -> np.ndarray:
    """float32 value of each of the 256 codes (NaN codes decode to NaN, E5M2 has +-inf)."""
    codes = np.arange(256, dtype=np.int64)
    mbits, bias = fmt.mantissa_bits, fmt.exponent_bias
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mbits) & ((1 << (7 - mbits)) - 1)
    mantissa = codes & ((1 << mbits) - 1)
    subnormal = mantissa * 2.0 ** (1 - bias - mbits)
    normal = (1.0 + mantissa / 2.0 ** mbits) * 2.0 ** (exponent.astype(np.float64) - bias)
    value = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << (7 - mbits)) - 1
    if fmt is Format.E4M3:
        value[top & (mantissa == 7)] = np.nan
    else:
        value[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        value[top & (mantissa != 0)] = np.nan
    table = value.astype(np.float32)
    table.setflags(write=False)
    return table


def decode_fp8(codes, fmt: Format) -> np.ndarray:
    """float32 values of uint8 FP8 codes."""
    return fp8_decode_table(fmt)[np.asarray(codes, dtype=np.uint8)]


# --------------------------------------------------------------------------------------------
# Block helpers


def _block_lengths(n: int, block: int):
    """Lengths of the cdiv(n, block) blocks along an axis of n: ``block`` itself when every
    block is whole, else an int array whose last entry is the short edge block."""
    if n % block == 0:
        return block
    lengths = np.full(cdiv(n, block), block, dtype=np.intp)
    lengths[-1] = n % block
    return lengths


def _max_over_blocks(a: np.ndarray, block: int, axis: int) -> np.ndarray:
    """``fmax`` over consecutive runs of `block` along `axis` (0 or 1) of a 2-D array; the edge
    run may be short. Nothing is padded, so memory stays proportional to the input."""
    n = a.shape[axis]
    if block == 1:
        return a
    if 0 < n <= block:  # one block, maybe short: a plain reduction
        return np.fmax.reduce(a, axis=axis, keepdims=True, initial=np.float32(0))
    if n % block == 0:
        shape = (n // block, block, a.shape[1]) if axis == 0 else (a.shape[0], n // block, block)
        return np.fmax.reduce(a.reshape(shape), axis=axis + 1, initial=np.float32(0))
    return np.fmax.reduceat(a, np.arange(0, n, block), axis=axis)


def block_amax(x2d, block_rows: int, block_cols: int) -> np.ndarray:
    """max |x| of each (block_rows x block_cols) block of a 2-D array, as ``fmaxf`` from 0.

    Returns fp32 (cdiv(R, br), cdiv(C, bc)), never NaN (an all-NaN block gives 0). Temporary
    memory: one fp32 copy of the input (its magnitudes), edge blocks are not padded.
    """
    x = np.asarray(x2d).astype(np.float32, copy=False)
    amax = _max_over_blocks(_max_over_blocks(np.abs(x), block_rows, 0), block_cols, 1)
    return np.fmax(amax, np.float32(0))  # a run of NaNs reduces to NaN: fmaxf from 0 gives 0


def _expand_blocks(values, block_rows, block_cols, rows, cols):
    """Per-block values (cdiv(rows, br), cdiv(cols, bc)) -> per-element (rows, cols), the edge
    blocks cropped (never materialized beyond the output's size)."""
    values = np.asarray(values)[: cdiv(rows, block_rows), : cdiv(cols, block_cols)]
    return np.repeat(np.repeat(values, _block_lengths(rows, block_rows), axis=0),
                     _block_lengths(cols, block_cols), axis=1)


def _cast_blocks(x2d, block_rows: int, block_cols: int, multiplier, fmt: Format) -> np.ndarray:
    """FP8 bytes of ``fl32(x * multiplier[block])`` for a 2-D array, shape of x2d."""
    rows, cols = x2d.shape
    x = np.asarray(x2d).astype(np.float32, copy=False)
    with np.errstate(all="ignore"):
        if rows % block_rows == 0 and cols % block_cols == 0:
            scaled = (x.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
                      * multiplier[:, None, :, None]).reshape(rows, cols)
        else:
            scaled = x * _expand_blocks(multiplier, block_rows, block_cols, rows, cols)
    return encode_fp8(scaled, fmt)


def _pad2d(a: np.ndarray, rows: int, cols: int, fill) -> np.ndarray:
    out = np.full((rows, cols), fill, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _fp32_scale(amax, recipe, value_for_inf):
    return scaling.fp32_scale_from_amax(amax, recipe.fmt, recipe.pow2_scales,
                                        recipe.amax_epsilon, value_for_inf)


# --------------------------------------------------------------------------------------------
# Quantize


def _block1d(x2d, recipe: Block1D, value_for_inf, columnwise: bool):
    """Block1D buffers for one direction of an (M, K) array.

    rowwise: 1x128 blocks, data (M, K), scale_inv (cdiv(K,128), round4(M)) holding [kb, m];
    columnwise: 128x1 blocks, data (K, M), scale_inv (cdiv(M,128), round4(K)) holding [mb, k].
    The columnwise data is cast in (M, K) order and transposed as bytes, a quarter of the
    traffic of transposing the fp32 input.
    """
    rows, cols = x2d.shape
    block = (128, 1) if columnwise else (1, 128)
    scale = _fp32_scale(block_amax(x2d, *block), recipe, value_for_inf)
    data = _cast_blocks(x2d, *block, scale, recipe.fmt)
    scale_inv = scaling.scale_inv_from_scale(scale)
    if columnwise:
        return (np.ascontiguousarray(data.T),
                _pad2d(scale_inv, cdiv(rows, 128), round_up(cols, 4), np.float32(1)))
    return data, _pad2d(scale_inv.T, cdiv(cols, 128), round_up(rows, 4), np.float32(1))


def quantize(x2d, recipe, rowwise: bool = True, columnwise: bool = False, dtype=None,
             out=None):
    """Quantize a 2-D (M, K) float32/float16/bfloat16 array.

    ``dtype`` (the logical input dtype) is accepted for the kernels' signature and ignored: a
    host array carries its own dtype.

    Returns ``(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv)``, with
    None for a direction not asked for, in the layouts of docs/layouts.md:

    ========  =========================================  ==========================================
    recipe    rowwise data / scale_inv                   columnwise data / scale_inv
    ========  =========================================  ==========================================
    Block1D   (M,K) u8 / f32 (cdiv(K,128), round4(M))    (K,M) u8 / f32 (cdiv(M,128), round4(K))
    Block2D   (M,K) u8 / f32 (cdiv(M,128),               (K,M) u8 = rowwise.T / f32 (cdiv(K,128),
              round4(cdiv(K,128)))                       round4(cdiv(M,128)))
    MXFP8     (M,K) u8 / u8 (round128(M), round4(K/32))  (M,K) u8 / u8 (round4(M/32), round128(K))
    ========  =========================================  ==========================================

    Scale padding is 1.0 (fp32) or 0 (E8M0). ``out``: None, or four arrays (None entries
    allowed) of exactly these layouts that receive the results in place (and are returned).
    """
    if out is not None:
        return _into(out, quantize(x2d, recipe, rowwise, columnwise, dtype))
    x2d = np.asarray(x2d)
    value_for_inf = scaling.dtype_max(x2d.dtype)
    rows, cols = x2d.shape
    row_data = row_sinv = col_data = col_sinv = None
    if isinstance(recipe, Block1D):
        if rowwise:
            row_data, row_sinv = _block1d(x2d, recipe, value_for_inf, columnwise=False)
        if columnwise:
            col_data, col_sinv = _block1d(x2d, recipe, value_for_inf, columnwise=True)
    elif isinstance(recipe, Block2D):
        scale = _fp32_scale(block_amax(x2d, 128, 128), recipe, value_for_inf)
        tile_scale_inv = scaling.scale_inv_from_scale(scale)
        data = _cast_blocks(x2d, 128, 128, scale, recipe.fmt)
        if rowwise:
            row_data = data
            row_sinv = _pad2d(tile_scale_inv, cdiv(rows, 128), round_up(cdiv(cols, 128), 4),
                              np.float32(1))
        if columnwise:
            col_data, col_sinv = block2d_columnwise_from_rowwise(data, tile_scale_inv)
    elif isinstance(recipe, MXFP8):
        if rowwise:
            codes = scaling.e8m0_from_amax(block_amax(x2d, 1, 32), recipe.fmt)
            row_data = _cast_blocks(x2d, 1, 32, scaling.e8m0_cast_multiplier(codes), recipe.fmt)
            row_sinv = _pad2d(codes, round_up(rows, 128), round_up(cols // 32, 4), np.uint8(0))
        if columnwise:
            codes = scaling.e8m0_from_amax(block_amax(x2d, 32, 1), recipe.fmt)
            col_data = _cast_blocks(x2d, 32, 1, scaling.e8m0_cast_multiplier(codes), recipe.fmt)
            col_sinv = _pad2d(codes, round_up(rows // 32, 4), round_up(cols, 128), np.uint8(0))
    else:  # pragma: no cover - callers validate
        raise TypeError(f"unknown recipe {recipe!r}")
    return row_data, row_sinv, col_data, col_sinv


def _into(out, results):
    """Copy `results` into the given `out` buffers; a None target keeps the new array."""
    final = []
    for target, value in zip(out, results):
        if target is None or value is None:
            final.append(value)
        else:
            target[...] = value
            final.append(target)
    return tuple(final)


def block2d_columnwise_from_rowwise(rowwise_data, rowwise_scale_inv, out=(None, None)):
    """Block2D columnwise buffers from rowwise ones: FP8 transpose of the data, transpose of the
    tile scales. ``rowwise_scale_inv`` may be padded (its padding columns are dropped).

    Returns (columnwise_data (K, M) uint8, columnwise_scale_inv fp32 (cdiv(K,128),
    round4(cdiv(M,128))) padded with 1.0). Buffers given in ``out`` are written in place.
    """
    rows, cols = rowwise_data.shape
    m_tiles, k_tiles = cdiv(rows, 128), cdiv(cols, 128)
    tile_scale_inv = np.asarray(rowwise_scale_inv)[:m_tiles, :k_tiles]
    col_data = np.ascontiguousarray(np.asarray(rowwise_data).T)
    col_sinv = _pad2d(np.ascontiguousarray(tile_scale_inv.T), k_tiles, round_up(m_tiles, 4),
                      np.float32(1))
    out_data, out_sinv = out
    if out_data is not None:
        out_data[...] = col_data
        col_data = out_data
    if out_sinv is not None:
        out_sinv[...] = col_sinv
        col_sinv = out_sinv
    return col_data, col_sinv


# --------------------------------------------------------------------------------------------
# Dequantize


def dequantize(recipe, shape2d, rowwise_data=None, rowwise_scale_inv=None,
               columnwise_data=None, columnwise_scale_inv=None, dtype=np.float32):
    """(M, K) array of `dtype` from rowwise buffers if given, else from columnwise buffers.

    Each element is ``fl32(decode(byte) * scale_inv)`` rounded once to `dtype`.
    """
    rows, cols = shape2d
    fmt = recipe.fmt
    if rowwise_data is not None:
        values = decode_fp8(rowwise_data, fmt)
        if isinstance(recipe, Block1D):
            factor = _expand_blocks(np.asarray(rowwise_scale_inv)[:, :rows].T, 1, 128, rows, cols)
        elif isinstance(recipe, Block2D):
            factor = _expand_blocks(np.asarray(rowwise_scale_inv)[: cdiv(rows, 128),
                                                                 : cdiv(cols, 128)],
                                    128, 128, rows, cols)
        else:
            factor = _expand_blocks(scaling.e8m0_decode(
                np.asarray(rowwise_scale_inv)[:rows, : cols // 32]), 1, 32, rows, cols)
    elif columnwise_data is not None:
        if isinstance(recipe, MXFP8):
            values = decode_fp8(columnwise_data, fmt)
            factor = _expand_blocks(scaling.e8m0_decode(
                np.asarray(columnwise_scale_inv)[: rows // 32, :cols]), 32, 1, rows, cols)
        else:
            values = decode_fp8(np.asarray(columnwise_data).T, fmt)  # back to (M, K)
            if isinstance(recipe, Block1D):
                factor = _expand_blocks(np.asarray(columnwise_scale_inv)[:, :cols], 128, 1,
                                        rows, cols)
            else:
                factor = _expand_blocks(np.asarray(columnwise_scale_inv)[: cdiv(cols, 128),
                                                                        : cdiv(rows, 128)].T,
                                        128, 128, rows, cols)
    else:
        raise ValueError("nothing to dequantize: the tensor holds neither rowwise nor "
                         "columnwise data")
    with np.errstate(all="ignore"):  # values beyond fp16's range round to inf, as specified
        out = (values * factor).astype(np.float32)
        return out.astype(dtype)


# --------------------------------------------------------------------------------------------
# Partial amax / partial cast over a flat shard of an (h, w) weight (master-weight path)


def _shard_rows(shape, start, n, block_rows):
    """Row range [r0, r1) of whole block-rows that covers flat elements [start, start+n)."""
    h, w = shape
    first, last = start // w, (start + n - 1) // w
    r0 = (first // block_rows) * block_rows
    r1 = min(round_up(last + 1, block_rows), h)
    return r0, r1


def _check_shard(shard, shape, start):
    h, w = shape
    n = int(np.asarray(shard).size)
    if start < 0 or start + n > h * w:
        raise ValueError(f"shard [{start}, {start + n}) is outside the {h}x{w} weight")
    return n


def _partial_block_amax(shard, shape, start, block_rows, block_cols):
    h, w = shape
    n = _check_shard(shard, shape, start)
    out = np.zeros((cdiv(h, block_rows), cdiv(w, block_cols)), dtype=np.float32)
    if n == 0:
        return out
    r0, r1 = _shard_rows(shape, start, n, block_rows)
    window = np.zeros((r1 - r0) * w, dtype=np.float32)
    offset = start - r0 * w
    window[offset: offset + n] = np.asarray(shard).reshape(-1).astype(np.float32)
    out[r0 // block_rows: cdiv(r1, block_rows)] = block_amax(window.reshape(r1 - r0, w),
                                                             block_rows, block_cols)
    return out


def partial_amax(shard, shape, start, recipe, columnwise: bool = True):
    """Block amaxes of the elements a flat shard of a row-major (h, w) weight holds.

    ``shard`` is 1-D (fp32/bf16/fp16) and covers flat indices [start, start + len(shard)).
    Returns ``(rowwise_amax, columnwise_amax)``, fp32:
      Block2D: (cdiv(h,128), cdiv(w,128)) and None;
      MXFP8:   (h, w/32) for 1x32 blocks and, if `columnwise`, (h/32, w) for 32x1 blocks.
    Blocks the shard does not touch hold 0 and NaN elements are ignored, so the elementwise
    max over all shards' results equals ``block_amax`` of the whole weight (and an all-reduce
    MAX of these buffers is exact: they hold no NaN).
    """
    if isinstance(recipe, Block2D):
        return _partial_block_amax(shard, shape, start, 128, 128), None
    if isinstance(recipe, MXFP8):
        row = _partial_block_amax(shard, shape, start, 1, 32)
        col = _partial_block_amax(shard, shape, start, 32, 1) if columnwise else None
        return row, col
    raise TypeError(f"partial amax supports Block2D and MXFP8, got {recipe!r}")


def partial_cast(shard, shape, start, recipe, rowwise_scale, columnwise_scale=None):
    """FP8 bytes for the elements of a flat shard of a row-major (h, w) weight.

    ``rowwise_scale`` is the fp32 tile scale (cdiv(h,128), cdiv(w,128)) for Block2D, or the
    E8M0 codes (h, w/32) for MXFP8; ``columnwise_scale`` the E8M0 codes (h/32, w) (MXFP8 only).
    Returns ``(rowwise_bytes, columnwise_bytes or None)``, each uint8 (n,), the bytes at flat
    positions [start, start+n) of the (h, w) rowwise (and MXFP8 columnwise) data.
    """
    h, w = shape
    n = _check_shard(shard, shape, start)
    flat = np.arange(start, start + n, dtype=np.int64)
    rows, cols = flat // w, flat % w
    x = np.asarray(shard).reshape(-1).astype(np.float32)
    if isinstance(recipe, Block2D):
        multiplier = np.asarray(rowwise_scale, dtype=np.float32)[rows // 128, cols // 128]
        with np.errstate(all="ignore"):
            return encode_fp8(x * multiplier, recipe.fmt), None
    if not isinstance(recipe, MXFP8):
        raise TypeError(f"partial cast supports Block2D and MXFP8, got {recipe!r}")
    with np.errstate(all="ignore"):
        row_mult = scaling.e8m0_cast_multiplier(np.asarray(rowwise_scale)[rows, cols // 32])
        row_bytes = encode_fp8(x * row_mult, recipe.fmt)
        col_bytes = None
        if columnwise_scale is not None:
            col_mult = scaling.e8m0_cast_multiplier(np.asarray(columnwise_scale)[rows // 32, cols])
            col_bytes = encode_fp8(x * col_mult, recipe.fmt)
    return row_bytes, col_bytes
