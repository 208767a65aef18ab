"""Device helpers shared by the kernels: input decoding, scale rules, padding fill.

All are Numba device functions (inlined) built by cached factories, so recipe constants (format
max, epsilon, pow2) are compile-time constants of each specialized kernel. Numerics follow
DESIGN §3 exactly; under the simulator they run as NumPy float32 scalar code.

Input chunks: a kernel holds its input as uint32 words, 16 bytes per chunk: 4 float32, or 8
bf16/fp16 (element 2i in the low half of word i). Elements outside the tensor are filled with
NaN bit patterns (:data:`NAN_WORD`), which every block amax ignores.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._numba import bf16x2_f32, bits_f32, device, f16x2_f32, f32_bits, st_b32, types

F32, BF16, F16 = 0, 1, 2  # input kinds
ELEMS_PER_CHUNK = {F32: 4, BF16: 8, F16: 8}
ITEMSIZE = {F32: 4, BF16: 2, F16: 2}
NAN_WORD = {F32: 0x7FC00000, BF16: 0x7FC07FC0, F16: 0x7E007E00}
NAN_HALF = {BF16: 0x7FC0, F16: 0x7E00}


@lru_cache(maxsize=None)
def element_decoder(kind):
    """``elem(raw, j, e)``: float32 value of element e (0..VE-1) of chunk j of a local
    ``raw[NJ, 4]`` uint32 array (e must be a compile-time constant after unrolling)."""
    if kind == F32:
        @device
        def elem(raw, j, e):
            return bits_f32(raw[j, e])
    elif kind == BF16:
        @device
        def elem(raw, j, e):
            lo, hi = bf16x2_f32(raw[j, e >> 1])
            return lo if (e & 1) == 0 else hi
    else:
        @device
        def elem(raw, j, e):
            lo, hi = f16x2_f32(raw[j, e >> 1])
            return lo if (e & 1) == 0 else hi
    return elem


@lru_cache(maxsize=None)
def word_decoder(kind):
    """``(lo, hi) = word_f32(w)``: the two float32 values of a uint32 word holding two bf16
    or fp16 (element 0 in the low half)."""
    if kind == BF16:
        @device
        def word_f32(w):
            return bf16x2_f32(w)
    else:
        @device
        def word_f32(w):
            return f16x2_f32(w)
    return word_f32


_INF = np.float32(np.inf)
_ONE = np.float32(1.0)


@device
def fp32_scale(amax, fmax, pow2, eps, value_for_inf):
    """DESIGN §3 steps 1-5 (scaling.fp32_scale_from_amax): the fp32 scale of a block amax.
    The quantize kernels pass the recipe as compile-time constants (fp32_scale_rule), so the
    untaken branches fold away; one master-weight launch covers weights of different
    recipes, so it passes fields read from its table at run time."""
    a = amax
    if eps > 0 and a < eps:
        a = eps
    if a == 0 or a != a or a == _INF:
        s = _ONE
    else:
        s = fmax / a
        if s == _INF:
            s = value_for_inf
    if pow2:
        s = bits_f32(f32_bits(s) & 0xFF800000)
    return s


@lru_cache(maxsize=None)
def fp32_scale_rule(fmt_max, pow2, eps, value_for_inf):
    """``scale(amax) -> (scale, scale_inv)`` for Block1D/Block2D, the recipe folded in."""
    F = np.float32(fmt_max)
    EPS = np.float32(eps)
    VINF = np.float32(value_for_inf)

    @device
    def scale(amax):
        s = fp32_scale(amax, F, pow2, EPS, VINF)
        return s, _ONE / s
    return scale


@device
def e8m0_code(amax, inv_f):
    """E8M0 code (0..255) of a block amax (DESIGN §3; scaling.e8m0_from_amax), inv_f =
    fl32(1/F). Branch-free: round the exponent of v = amax / F up when the mantissa is
    non-zero (except subnormals <= 2**-127, which round down), capped at 254, which also
    covers v = inf and the 0xFE exponent; NaN -> 255."""
    v = amax * inv_f
    b = f32_bits(v)
    e = int((b >> 23) & 0xFF)
    mant = int(b & 0x7FFFFF)
    c = e + 1 if (mant != 0 and not (e == 0 and mant <= 0x400000)) else e
    c = min(c, 254)
    if v != v:
        c = 255
    return c


@device
def e8m0_multiplier(code):
    """The fp32 cast multiplier 2**(127 - code) of an E8M0 code, as TE's exp2f_rcp
    (scaling.e8m0_cast_multiplier): 0 -> 1, 255 -> -inf (bits_f32 keeps the low 32 bits).
    ``int``: codes arrive as uint8/uint32, whose own arithmetic would wrap (simulator)."""
    if code == 0:
        return _ONE
    return bits_f32((254 - int(code)) << 23)


@lru_cache(maxsize=None)
def e8m0_rule(fmt_max):
    """``code(amax) -> (code, multiplier)``: E8M0 code (0..255) and its cast multiplier, the
    format folded in."""
    INV_F = np.float32(1.0) / np.float32(fmt_max)

    @device
    def code(amax):
        c = e8m0_code(amax, INV_F)
        return c, e8m0_multiplier(c)
    return code


@device
def fill_padding(p, rows_valid, cols_valid, rows_total, cols_total, value, gtid, gsize):
    """Write `value` to every entry of the row-major (rows_total, cols_total) array at `p`
    outside [0, rows_valid) x [0, cols_valid); grid-stride over those entries (thread `gtid`
    of `gsize`). Used for the padding of scale tensors (DESIGN §4).

    Index arithmetic is unsigned 32-bit (scale tensors have < 2**32 entries): a signed 64-bit
    division makes the compiler emit calls to a division subroutine, and any call caps the
    whole kernel at the call ABI's 64 registers (measured with ptxas: the MXFP8 row+col kernel
    spilled at 64 registers with the calls, and uses 73 without)."""
    u32 = types.uint32
    rv = u32(rows_valid)
    cv = u32(cols_valid)
    ct = u32(cols_total)
    n_bottom = u32((u32(rows_total) - rv) * ct)
    width = u32(ct - cv)
    n_all = u32(n_bottom + rv * width)
    i = u32(gtid)
    step = u32(gsize)
    while i < n_all:
        if i < n_bottom:
            r = u32(rv + u32(i // ct))
            c = u32(i % ct)
        else:
            i2 = u32(i - n_bottom)
            r = u32(i2 // width)
            c = u32(cv + u32(i2 % width))
        p[u32(r * ct + c)] = value
        i = u32(i + step)


@device
def store_tile_rows_unaligned(tb, dst, k0, m0, K, M, TKT, TMT, tid, nthreads):
    """Write a shared tile of transposed bytes to an (K, M) byte array whose rows are not
    16-byte aligned (M % 16 != 0).

    ``tb[kk, w]`` (uint32, >= TMT/4 + 1 words per row) holds bytes m0 + 4w .. m0 + 4w + 3 of
    output row k0 + kk; `dst` is a uint8 pointer to the whole (K, M) output. Each warp takes a
    row; its lanes store the row's aligned 4-byte words (consecutive lanes on consecutive words:
    coalesced), shifting bytes across two shared words when the row starts mid-word, and up to
    3 bytes at each end with byte stores. Columns >= M and rows >= K are skipped.
    """
    warp = tid // 32
    lane = tid % 32
    mend = min(m0 + TMT, M)
    kk = warp
    while kk < TKT:
        k = k0 + kk
        if k < K:
            base = k * M + m0
            end = k * M + mend
            w0 = (base + 3) // 4
            w1 = end // 4
            w = w0 + lane
            while w < w1:
                off = 4 * w - base
                q = off // 4
                h = off % 4
                v = types.uint32(tb[kk, q])
                if h != 0:
                    v = types.uint32(((v >> (8 * h)) | (tb[kk, q + 1] << (32 - 8 * h)))
                                     & 0xFFFFFFFF)
                st_b32(dst, 4 * w, v)
                w += 32
            head_end = min(4 * w0, end)
            tail_start = max(4 * w1, head_end)
            if lane < 3:
                a = base + lane
                if a < head_end:
                    off = a - base
                    dst[a] = (tb[kk, off // 4] >> (8 * (off % 4))) & 0xFF
            elif lane < 6:
                a = tail_start + lane - 3
                if a < end:
                    off = a - base
                    dst[a] = (tb[kk, off // 4] >> (8 * (off % 4))) & 0xFF
        kk += nthreads // 32
