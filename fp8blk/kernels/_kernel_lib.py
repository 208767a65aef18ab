"""Device helpers shared by the kernels: input decoding, scale rules, padding fill.

All are Numba device functions (inlined) built by cached factories, so recipe constants (format
max, epsilon, pow2) are compile-time constants of each specialized kernel. Numerics follow
docs/numerics.md exactly; under the simulator they run as NumPy float32 scalar code.

Input chunks: a kernel holds its input as uint32 words, 16 bytes per chunk: 4 float32, or 8
bf16/fp16 (element 2i in the low half of word i). Elements outside the tensor are filled with
NaN bit patterns (``_specs.NAN_WORD``), which every block amax ignores.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._numba import (addr_of, bf16x2_cvt, bf16x2_f32, bits_f32, cuda, device, f16x2_cvt,
                     f16x2_f32, f32_bits, ld_v4_at, prmt, st8_u8, st8_u16, st8_u32, st_v2_at,
                     st_v4_at, types)

from ._specs import BF16, F32


def torch_pair_codec(kind):
    """(unpack, pack) of a uint32 word holding two bf16 (``kind`` BF16) or fp16 values: to two
    float32, and from two float32 rounded to nearest even, a NaN written as torch's CUDA
    conversions write it (0x7FFF), for kernels whose bytes must be torch's."""
    return (bf16x2_f32, bf16x2_cvt) if kind == BF16 else (f16x2_f32, f16x2_cvt)


@device
def chunk_of(it, iters, threads, rows, per_row):
    """(inside, row, column chunk) of this thread's `it`-th 16-byte chunk of a (rows, per_row
    chunks) array, chunks walked CTA-strided: chunk ``(blockIdx * iters + it) * threads +
    threadIdx`` (a warp's loads coalesce); elementwise kernels (``_silu_gate_kernel``,
    ``_weighted_rows_kernel``) loop over ``it < iters``."""
    c = (cuda.blockIdx.x * iters + it) * threads + cuda.threadIdx.x
    row = c // per_row
    return c < rows * per_row, row, c - row * per_row


@device
def ld_v4_at_or(p, off, ok, fill):
    """Four uint32 words at byte offset `off` of `p` (one 16-byte load, `off` 16-byte aligned)
    if `ok`, else four `fill` words (a chunk outside the tensor)."""
    if ok:
        return ld_v4_at(p, off)
    return fill, fill, fill, fill


@device
def byte_window(lo, hi, o):
    """Bytes o % 4 .. o % 4 + 3 of the 8 bytes hi:lo (byte 0 = the lowest byte of lo) as one
    word, byte o % 4 lowest (one ``prmt``): shifts a run of words by a byte offset."""
    u32 = types.uint32
    return prmt(lo, hi, u32(u32(0x3210) + u32(0x1111) * u32(u32(o) & u32(3))))


@device
def transpose_bytes_4x4(r0, r1, r2, r3):
    """Transpose a 4x4 block of bytes held as 4 row words (byte j of word i = element (i, j),
    little-endian): returns the 4 column words (byte i of word j = element (i, j))."""
    t0 = prmt(r0, r1, types.uint32(0x5140))
    t1 = prmt(r0, r1, types.uint32(0x7362))
    t2 = prmt(r2, r3, types.uint32(0x5140))
    t3 = prmt(r2, r3, types.uint32(0x7362))
    return (prmt(t0, t2, types.uint32(0x5410)), prmt(t0, t2, types.uint32(0x7632)),
            prmt(t1, t3, types.uint32(0x5410)), prmt(t1, t3, types.uint32(0x7632)))


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
    """docs/numerics.md steps 1-5 (scaling.fp32_scale_from_amax): the fp32 scale of a block amax.
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
    """E8M0 code (0..255) of a block amax (docs/numerics.md; scaling.e8m0_from_amax), inv_f =
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
    (scaling.e8m0_cast_multiplier): bits (254 - code) << 23, so 0 -> 2**127; 254 -> 2**-127
    (0x00400000), 255 -> NaN (0x7FFFFFFF). ``int``: codes arrive as uint8/uint32, whose own
    arithmetic would wrap (simulator)."""
    c = int(code)
    if c >= 254:
        return bits_f32(0x00400000 if c == 254 else 0x7FFFFFFF)
    return bits_f32((254 - c) << 23)


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
    of `gsize`). Used for the padding of scale tensors (docs/layouts.md).

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


@lru_cache(maxsize=None)
def tile_storer(tile_rows, row_bytes, nthreads, aligned):
    """``store(tb, dst, k0, m0, K, M, tid)``: write a shared tile of transposed bytes (the
    layout of :func:`tile_row_storer`) to the (K, M) byte array `dst`. `aligned` (M % 16 == 0,
    `dst` 16-byte aligned): every 16 bytes of a tile row with one 16-byte store, a CTA's
    `nthreads` threads taking consecutive chunks; else :func:`tile_row_storer`."""
    if not aligned:
        return tile_row_storer(tile_rows, row_bytes, nthreads)
    NOUT = tile_rows * row_bytes // 16 // nthreads    # 16-byte stores per thread
    PARTS = row_bytes // 16                          # 16-byte chunks per tile row

    @device
    def store(tb, dst, k0, m0, K, M, tid):
        for it in range(NOUT):
            u = tid + nthreads * it
            kk = u // PARTS
            part = u % PARTS
            k = k0 + kk
            mm = m0 + part * 16
            if k < K and mm < M:
                st_v4_at(dst, k * M + mm, tb[kk, part * 4], tb[kk, part * 4 + 1],
                         tb[kk, part * 4 + 2], tb[kk, part * 4 + 3])
    return store


@lru_cache(maxsize=None)
def tile_row_storer(tile_rows, row_bytes, nthreads):
    """``store(tb, dst, k0, m0, K, M, tid)``: write a shared tile of transposed bytes to a
    (K, M) byte array whose rows need not be 16-byte aligned (M % 16 != 0, or any address).

    ``tb[kk, w]`` (uint32, >= 33 words per row; word 32 is padding) holds bytes m0 + 4w ..
    m0 + 4w + 3 of output row k0 + kk (kk < `tile_rows`; `row_bytes` must be 128); `dst` is a
    uint8 pointer to the whole (K, M) output; all `nthreads` threads of the CTA call it with
    their `tid`. Columns >= M and rows >= K are skipped, and bytes of other tiles are never
    written (neighbouring tiles share the 16-byte chunks at their row ends).

    Row k's bytes start at ``dst + k * M + m0``, whose offset d = address % 16 varies per row
    (each row is one constant shift of the tile's words, so there is no per-word division):
      * main pass: 8 lanes per row; lane p stores the 16-byte aligned chunk p of the row
        (tile bytes 16p - d .. 16p - d + 15) with one 16-byte store if it lies wholly inside
        the row, building its 4 words from 5 shared words with ``prmt`` (one selector per row);
      * edge pass: one thread per row end; the partial chunk at the head (tile bytes
        0 .. 15 - d) and the one at the tail (the last (n + d) % 16 bytes) are written with
        at most 4 stores each, of 1, 2, 4 and 8 bytes, each at its natural alignment;
      * a tile narrower than 16 bytes (the last one when M % 128 < 16) is stored byte by byte.
    All index arithmetic inside the tile is 32-bit; only the row offset k * M is 64-bit.
    """
    TR = tile_rows
    NT = nthreads
    RPP = NT // 8                       # rows per main pass (8 lanes per row)
    assert row_bytes == 128, "the chunk arithmetic assumes 128-byte tile rows"
    assert NT % 32 == 0 and TR % RPP == 0 and TR & (TR - 1) == 0
    PASSES = TR // RPP
    NEDGE = -(-2 * TR // NT)            # edge-pass iterations (one row end per thread)
    NNARROW = -(-16 * TR // NT)         # narrow-tile iterations (one byte per thread)
    u32 = types.uint32
    i32 = types.int32

    @device
    def bytes4(tb, kk, o):
        """Bytes o .. o + 3 of tile row kk as a word (byte o lowest); 0 <= o <= 127 (bytes
        past the row are garbage: word 32 of a row is padding)."""
        o = u32(o)
        q = o >> 2
        return byte_window(tb[kk, q], tb[kk, q + 1], o)

    @device
    def store(tb, dst, k0, m0, K, M, tid):
        n = i32(min(M - m0, 128))       # bytes of each tile row inside the output
        nrows = i32(min(K - k0, TR))    # tile rows inside the output
        base = u32(addr_of(dst) & 15)
        t32 = u32(tid)
        if n >= 16:
            p = t32 & 7
            g = t32 >> 3
            row = (k0 + g) * M + m0     # byte offset of tile row kk (the thread's first)
            step = RPP * M
            for it in range(PASSES):
                kk = u32(it * RPP) + g
                d = (base + u32(row)) & 15              # the row's address % 16
                lo = i32(i32(16 * p) - i32(d))          # tile byte of chunk p's first byte
                # row inside the output, chunk wholly inside the row (0 <= lo <= n - 16)
                if (i32(kk) < nrows) & (u32(lo) <= u32(n - 16)):
                    o = u32(lo)
                    q = o >> 2
                    w0 = tb[kk, q]
                    w1 = tb[kk, q + 1]
                    w2 = tb[kk, q + 2]
                    w3 = tb[kk, q + 3]
                    w4 = tb[kk, q + 4]
                    st_v4_at(dst, row + lo, byte_window(w0, w1, o), byte_window(w1, w2, o),
                             byte_window(w2, w3, o), byte_window(w3, w4, o))
                row += step
            for it in range(NEDGE):
                e = u32(it * NT) + t32
                kk = e & (TR - 1)
                if e < 2 * TR and i32(kk) < nrows:
                    row = (k0 + kk) * M + m0
                    d = (base + u32(row)) & 15
                    if e < TR:
                        # head: chunk bytes d .. 15 = tile bytes 0 .. 15 - d, rising sizes
                        cb = row - d                    # the chunk's offset (16-byte aligned)
                        x = d
                        if x & 1:
                            st8_u8(dst, cb + x, tb[kk, 0])
                            x = u32(x + 1)
                        if x & 2:
                            st8_u16(dst, cb + x, bytes4(tb, kk, x - d))
                            x = u32(x + 2)
                        if x & 4:
                            st8_u32(dst, cb + x, bytes4(tb, kk, x - d))
                            x = u32(x + 4)
                        if x & 8:
                            st_v2_at(dst, cb + x, bytes4(tb, kk, x - d), bytes4(tb, kk, x - d + 4))
                    else:
                        # tail: chunk bytes 0 .. t - 1 = the row's last t bytes, falling sizes
                        t = (u32(n) + d) & 15
                        ob = u32(n) - t                 # tile byte at chunk byte 0
                        cb = row + ob
                        x = u32(0)
                        if t & 8:
                            st_v2_at(dst, cb, bytes4(tb, kk, ob), bytes4(tb, kk, ob + 4))
                            x = u32(8)
                        if t & 4:
                            st8_u32(dst, cb + x, bytes4(tb, kk, ob + x))
                            x = u32(x + 4)
                        if t & 2:
                            st8_u16(dst, cb + x, bytes4(tb, kk, ob + x))
                            x = u32(x + 2)
                        if t & 1:
                            st8_u8(dst, cb + x, bytes4(tb, kk, ob + x))
        else:
            for it in range(NNARROW):
                e = u32(it * NT) + t32
                kk = e >> 4
                o = e & 15
                if kk < TR and i32(kk) < nrows and i32(o) < n:
                    st8_u8(dst, (k0 + kk) * M + m0 + o, bytes4(tb, kk, o))
    return store
