"""Builder of the GPU ``dequantize`` kernels (launcher: ``dequantize``):
``fl32(decode(byte) * scale_inv)`` rounded once to fp32/bf16/fp16 (same bytes as the
reference). Each kernel is generated from a ``_specs.DequantizeSpec`` alone.

Three kernels, each specialized per (recipe, direction, format, output dtype):

* ``rows`` -- sources in the (M, K) layout of the output (every rowwise buffer, MXFP8
  columnwise). The unit of work is a *piece*: E consecutive elements of one row whose output
  is 16 bytes (E = 4 for fp32, 8 for bf16/fp16). A lane loads the piece's E bytes (one 4- or
  8-byte non-coherent load) and its scale once (one fp32 scale_inv or E8M0 code; MXFP8
  columnwise: the piece's E codes in one load), decodes with the hardware FP8 -> f16x2
  conversion, multiplies in fp32, rounds once and writes one 16-byte store. Consecutive lanes
  take consecutive pieces of a row (2**lpr_shift lanes per row, chosen from K so narrow
  tensors keep the lanes busy), so every load and store instruction of a warp is contiguous.
  A thread handles ``spec.rows_per_thread`` rows, all loads issued before any use.
  Needs K % E == 0 and E-aligned pointers; 16-bit outputs with only K % 4 == 0 and 4-aligned
  data use pieces of E = 4 elements (4-byte loads, 8-byte stores) instead. (Pieces are sized
  by the output, not the input: a 16-byte input load per lane would need two 16-byte stores
  32 bytes apart per lane for bf16, each warp store instruction then half-filling twice as
  many sectors.)
* ``tiles`` -- the transposed (K, M) columnwise sources of Block1D / Block2D. A CTA of 256
  threads owns a 128 x 128 byte tile (128 source rows k, 128 columns m): each thread loads
  four 16-byte chunks of 4 consecutive rows, transposes the 4 x 16 bytes in registers with
  ``prmt`` into words of 4 consecutive k, and writes them to a shared tile [m][k/4] (+1 word of
  padding per row; the lane mapping makes both the shared writes and the reads conflict-free).
  After one barrier, each thread converts pieces of output rows as above; its k range is the
  same in every row it visits, so it fetches its scales once per tile (Block1D: E per-column
  scale_inv; Block2D: the tile's one scale_inv). Needs K % E == 0 (or 4-element pieces as
  above). When the source rows are not 16-byte aligned (M % 16 != 0 or an unaligned
  buffer; ``aligned=False``), row k's 16 bytes at offset a start d = address % 16 into an
  aligned chunk: the thread loads that chunk and the next (two 16-byte loads per row, issued
  before any shift; rows / chunks past the edges load the tile's last row / first chunk
  instead, never stored) and shifts them by d (word selects, then ``prmt``). Tiles whose
  chunks could reach outside the buffer (at its first or last bytes) check each row and load
  the second chunk only when needed, or the row's bytes one by one.
* ``scalar`` -- the general fallback: one thread per output element, the same hardware
  decoding (K % 4 != 0; (M, K) sources whose address is not a multiple of the piece size;
  MXFP8 columnwise scales not aligned likewise).

NaN results are written as the quiet NaN NumPy produces (0x7FC00000, bf16 0x7FC0, fp16
0x7E00), not the GPU's canonical one; E5M2 +-inf stays +-inf. Index arithmetic is 64-bit for
global offsets (M*K may exceed 2**31); per-thread coordinates are small.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._kernel_lib import byte_window, transpose_bytes_4x4
from ._specs import (BF16_OUT, BLOCK1D, BLOCK2D, BX, BY, DQ_THREADS, DQ_TILE,
                     F32_OUT, MXFP8, OUT_SIZE, ROWS, SCALAR, TILES, piece_of, transposed)
from ._specs import dequantize_launch_bounds as launch_bounds
from ._numba import (addr_of, bf16x2_pack, bits_f32, cuda, device,
                     f16x2_pack, f32_bf16_bits, f32_bits, f32_f16_bits, fp8x4_f32,
                     ld_u32_at, ld_v2_at, ld_v4_at, ptr, st_v2_at, st_v4_at, types)

THREADS = DQ_THREADS
T = DQ_TILE
MX = MXFP8


# ------------------------------------------------------------------------------------------
# Device helpers

_QNAN = np.float32(np.nan)  # 0x7FC00000


@device
def qnan_f32(y):
    """y, or the quiet NaN 0x7FC00000 when y is any NaN."""
    if y != y:
        return _QNAN
    return y


@device
def e8m0_factor(c):
    """``2**(c-127)`` of E8M0 code c (0..255): exponent field c, except 0 -> 2**-127
    (0x00400000) and 255 -> NaN (0x7FC00000), both the code's bits plus bit 22."""
    u32 = types.uint32
    c = u32(c)
    b = c << u32(23)
    if c == u32(0) or c == u32(255):
        b = b | u32(0x400000)
    return bits_f32(b)


@device
def e8m0_specials(c):
    """Non-zero iff one of the four E8M0 codes in uint32 c is 0 or 255 (SWAR: a code's low 7
    bits xor its top bit replicated is zero exactly for those two codes)."""
    u32 = types.uint32
    s = c & u32(0x80808080)
    z = (c & u32(0x7F7F7F7F)) ^ u32(s - (s >> u32(7)))       # bytes <= 0x7F, no borrows
    return u32(z - u32(0x01010101)) & ~z & u32(0x80808080)   # any zero byte


@device
def e8m0x4_factors(c):
    """The four factors ``2**(code-127)`` of the E8M0 codes in uint32 c (byte 0 first)."""
    u32 = types.uint32
    return (e8m0_factor(c & u32(0xFF)), e8m0_factor((c >> u32(8)) & u32(0xFF)),
            e8m0_factor((c >> u32(16)) & u32(0xFF)), e8m0_factor(c >> u32(24)))


@device
def e8m0x4_factors_plain(c):
    """e8m0x4_factors for codes known to be 1..254: just the exponent fields."""
    u32 = types.uint32
    m = u32(0x7F800000)
    return (bits_f32((c << u32(23)) & m), bits_f32((c << u32(15)) & m),
            bits_f32((c << u32(7)) & m), bits_f32((c >> u32(1)) & m))


@lru_cache(maxsize=None)
def piece_converter(e4m3, out_kind, elems=0):
    """``convert(w0, w1, f0..f7) -> (u0, u1, u2, u3)``: the output bytes of one piece of
    `elems` elements (default PIECE[out_kind]; 16 bytes, or 8 bytes in u0, u1 for a 4-element
    16-bit piece) from E FP8 bytes in words w0[, w1] (byte 0 first) with per-element factors
    f0..f(E-1); unused arguments are ignored (fp32 and 4-element pieces: w1 and f4..f7)."""
    dec = fp8x4_f32(e4m3)
    if out_kind != F32_OUT and elems == 4:
        pack4 = bf16x2_pack if out_kind == BF16_OUT else f16x2_pack
        zero = np.uint32(0)

        @device
        def convert(w0, w1, f0, f1, f2, f3, f4, f5, f6, f7):
            v0, v1, v2, v3 = dec(w0)
            return pack4(v0 * f0, v1 * f1), pack4(v2 * f2, v3 * f3), zero, zero
        return convert
    if out_kind == F32_OUT:
        @device
        def convert(w0, w1, f0, f1, f2, f3, f4, f5, f6, f7):
            v0, v1, v2, v3 = dec(w0)
            return (f32_bits(qnan_f32(v0 * f0)), f32_bits(qnan_f32(v1 * f1)),
                    f32_bits(qnan_f32(v2 * f2)), f32_bits(qnan_f32(v3 * f3)))
        return convert
    pack = bf16x2_pack if out_kind == BF16_OUT else f16x2_pack

    @device
    def convert(w0, w1, f0, f1, f2, f3, f4, f5, f6, f7):
        v0, v1, v2, v3 = dec(w0)
        v4, v5, v6, v7 = dec(w1)
        return (pack(v0 * f0, v1 * f1), pack(v2 * f2, v3 * f3),
                pack(v4 * f4, v5 * f5), pack(v6 * f6, v7 * f7))
    return convert


@lru_cache(maxsize=None)
def piece_storer(nbytes):
    """``store(out, off, u0, u1, u2, u3)``: the first `nbytes` (16 or 8) of a converted piece
    at byte offset `off` of uint32 pointer out (aligned to `nbytes`)."""
    if nbytes == 16:
        @device
        def store(out, off, u0, u1, u2, u3):
            st_v4_at(out, off, u0, u1, u2, u3)
    else:
        @device
        def store(out, off, u0, u1, u2, u3):
            st_v2_at(out, off, u0, u1)
    return store


# ------------------------------------------------------------------------------------------
# rows kernel: (M, K) sources


def _make_rows_pyfunc(spec):
    u32 = types.uint32
    E = piece_of(spec)
    NWD = E // 4                    # FP8 data words per piece
    OSZ = OUT_SIZE[spec.out_kind]
    PR = spec.rows_per_thread
    RK = spec.recipe
    MX_COL = RK == MX and spec.columnwise
    convert = piece_converter(spec.e4m3, spec.out_kind, E)
    store = piece_storer(E * OSZ)

    def kernel(data, sinv, out, M, K, ld, lpr_shift):
        """data: (M, K) bytes (uint32 pointer); sinv: scale_inv / E8M0 codes; out: (M, K)
        output (uint32 pointer); ld: sinv row length; lpr_shift: log2(lanes per row)."""
        tid = cuda.threadIdx.x
        k = ((cuda.blockIdx.x << lpr_shift) + (tid & ((1 << lpr_shift) - 1))) * E
        if k >= K:
            return
        rows_step = THREADS >> lpr_shift        # rows one pass of the CTA covers
        m_base = cuda.blockIdx.y * (rows_step * PR) + (tid >> lpr_shift)
        grid_step = cuda.gridDim.y * (rows_step * PR)
        kb = k >> 7                             # 128-element block of k
        step_off = rows_step * K                # data offset between a thread's rows
        # offset between a thread's rows in the row-linear scale layouts
        step_sidx = rows_step if RK == BLOCK1D else rows_step * ld
        words = cuda.local.array((PR, 2), u32)
        codes = cuda.local.array((PR, 2), u32)  # MXFP8 columnwise: the piece's E8M0 codes
        fac = cuda.local.array(PR, types.float32)
        while m_base < M:
            # all loads first
            m = m_base
            off = m_base * K + k                # byte offset of the piece in data
            if RK == BLOCK1D:
                sidx = kb * ld + m_base
            else:
                sidx = m_base * ld + (k >> 5)   # MXFP8 rowwise (unused by the others)
            for i in range(PR):
                if m < M:
                    if NWD == 1:
                        words[i, 0] = ld_u32_at(data, off)
                    else:
                        w0, w1 = ld_v2_at(data, off)
                        words[i, 0] = w0
                        words[i, 1] = w1
                    if RK == BLOCK1D:
                        fac[i] = sinv[sidx]
                    elif RK == BLOCK2D:
                        fac[i] = sinv[(m >> 7) * ld + kb]
                    elif not MX_COL:
                        fac[i] = e8m0_factor(sinv[sidx])
                    elif NWD == 1:
                        codes[i, 0] = ld_u32_at(sinv, (m >> 5) * ld + k)
                    else:
                        c0, c1 = ld_v2_at(sinv, (m >> 5) * ld + k)
                        codes[i, 0] = c0
                        codes[i, 1] = c1
                m += rows_step
                off += step_off
                sidx += step_sidx
            m = m_base
            off = m_base * K + k
            for i in range(PR):
                if m < M:
                    w0 = words[i, 0]
                    w1 = words[i, NWD - 1]
                    if MX_COL:
                        c0 = codes[i, 0]
                        c1 = codes[i, NWD - 1]
                        # codes 0 and 255 are rare: the common case is the exponent field
                        if e8m0_specials(c0) | e8m0_specials(c1):
                            f0, f1, f2, f3 = e8m0x4_factors(c0)
                            f4, f5, f6, f7 = e8m0x4_factors(c1)
                        else:
                            f0, f1, f2, f3 = e8m0x4_factors_plain(c0)
                            f4, f5, f6, f7 = e8m0x4_factors_plain(c1)
                        u0, u1, u2, u3 = convert(w0, w1, f0, f1, f2, f3, f4, f5, f6, f7)
                    else:
                        f = fac[i]
                        u0, u1, u2, u3 = convert(w0, w1, f, f, f, f, f, f, f, f)
                    store(out, off * OSZ, u0, u1, u2, u3)
                m += rows_step
                off += step_off
            m_base += grid_step

    return kernel


# ------------------------------------------------------------------------------------------
# tiles kernel: transposed (K, M) sources of Block1D / Block2D


@device
def shifted_chunk(x0, x1, x2, x3, x4, x5, x6, x7, d):
    """Bytes d .. d + 15 (0 <= d <= 15) of the 32 bytes in words x0..x7 (byte 0 lowest in
    x0), as four words: a word shift by d >> 2 through selects (no dynamically indexed
    registers), then a byte shift by d & 3 with prmt."""
    u32 = types.uint32
    d = u32(d)
    two = u32(d & u32(8)) != u32(0)
    one = u32(d & u32(4)) != u32(0)
    t0 = x2 if two else x0
    t1 = x3 if two else x1
    t2 = x4 if two else x2
    t3 = x5 if two else x3
    t4 = x6 if two else x4
    t5 = x7 if two else x5
    v0 = t1 if one else t0
    v1 = t2 if one else t1
    v2 = t3 if one else t2
    v3 = t4 if one else t3
    v4 = t5 if one else t4
    return (byte_window(v0, v1, d), byte_window(v1, v2, d), byte_window(v2, v3, d),
            byte_window(v3, v4, d))


@device
def ld_edge16(data, a, d, nvalid, total):
    """Bytes a .. a + nvalid - 1 of the `total`-byte buffer at uint8 pointer `data` (any
    alignment; d = the address of byte a % 16) as four words, the rest 0: the aligned chunk
    holding byte a (and the next one when the bytes reach into it) shifted when they lie
    inside the buffer, else byte by byte (tiles at the buffer's two ends)."""
    u32 = types.uint32
    a16 = a - types.int64(d)
    two = d + nvalid > u32(16)
    if a16 >= 0 and a16 + (32 if two else 16) <= total:
        x0, x1, x2, x3 = ld_v4_at(data, a16)
        x4 = x5 = x6 = x7 = u32(0)
        if two:
            x4, x5, x6, x7 = ld_v4_at(data, a16 + 16)
        return shifted_chunk(x0, x1, x2, x3, x4, x5, x6, x7, d)
    w0 = w1 = w2 = w3 = u32(0)
    for j in range(16):
        if u32(j) < nvalid:
            b = u32(data[a + j]) << u32(8 * (j & 3))
            if j < 4:
                w0 |= b
            elif j < 8:
                w1 |= b
            elif j < 12:
                w2 |= b
            else:
                w3 |= b
    return w0, w1, w2, w3


def _make_tiles_pyfunc(spec):
    u32 = types.uint32
    E = piece_of(spec)
    NWD = E // 4
    OSZ = OUT_SIZE[spec.out_kind]
    PPR = T // E                    # pieces per output row of the tile (16 or 32)
    PPR_SHIFT = PPR.bit_length() - 1
    RSTEP = THREADS // PPR          # output rows one pass covers
    B1D = spec.recipe == BLOCK1D
    ALIGNED = spec.aligned
    convert = piece_converter(spec.e4m3, spec.out_kind, E)
    store = piece_storer(E * OSZ)
    TB_SHAPE = (T, T // 4 + 1)      # [m][k/4] words, +1: conflict-free column reads

    def kernel(data, sinv, out, M, K, ld):
        """data: (K, M) bytes (uint32 pointer if `aligned`, else uint8 pointer); sinv: fp32
        scale_inv; out: (M, K) output (uint32 pointer); ld: sinv row length."""
        tid = u32(cuda.threadIdx.x)
        warp = tid >> u32(5)
        lane = tid & u32(31)
        # load mapping: chunk column c (16 bytes of m) and row quad q (4 rows of k); a warp
        # takes 2 adjacent chunks x 16 quads: full 32-byte sectors, conflict-free shared writes.
        # Shared-tile indices are unsigned (no negative-index wraparound code).
        c = u32(((warp & u32(3)) << u32(1)) | (lane & u32(1)))
        q = u32((lane >> u32(1)) | ((warp >> u32(2)) << u32(4)))
        # store mapping: piece `part` (E values of k, tile words wcol..) of output rows
        # r, r + RSTEP, ...
        part = tid & u32(PPR - 1)
        wcol = u32(part * NWD)
        r = tid >> u32(PPR_SHIFT)
        m0 = cuda.blockIdx.x * T
        mc = m0 + 16 * c
        tb = cuda.shared.array(TB_SHAPE, u32)
        rows = cuda.local.array((4, 4), u32)
        fac = cuda.local.array(8, types.float32)
        k0 = cuda.blockIdx.y * T
        interior = False
        if not ALIGNED:
            raw = cuda.local.array((4, 8), u32)     # two aligned chunks per row
            shift = cuda.local.array(4, u32)
            base = u32(addr_of(data)) & u32(15)     # the buffer's address % 16
            total = K * M
            # bytes of the thread's chunk inside a row (the rest belongs to the next row)
            nvalid = u32(min(M - mc, 16))
        while k0 < K:
            if not ALIGNED:
                # whether both aligned chunks of every row of the tile lie inside the buffer:
                # the first one of its first byte (offset lo) and the second one of its last
                # chunk (offset hi); the aligned chunk of offset a is at address
                # floor16(base + a) relative to the buffer's floor16 address
                lo = k0 * M + m0
                hi = (min(k0 + T, K) - 1) * M + m0 + 16 * min(7, (M - 1 - m0) >> 4)
                hi_end = ((hi + base) >> 4 << 4) + 32      # end of its second chunk
                interior = (base == u32(0) or lo + base >= 16) and hi_end <= total + base
            if ALIGNED:
                for i in range(4):
                    k = k0 + 4 * q + i
                    if k < K and mc < M:
                        w0, w1, w2, w3 = ld_v4_at(data, k * M + mc)
                        rows[i, 0] = w0
                        rows[i, 1] = w1
                        rows[i, 2] = w2
                        rows[i, 3] = w3
                    else:
                        for w in range(4):
                            rows[i, w] = u32(0)
            elif interior:
                # row k's 16 bytes start at any alignment d: the aligned chunk holding the
                # first byte and the next one, all loads in flight before the shifts. Rows
                # k >= K and chunks m >= M load bytes of the tile's last row / first chunk
                # instead (never stored), so the loads need no predicates.
                k_last = min(k0 + T, K) - 1
                mcl = mc if mc < M else m0
                for i in range(4):
                    a = min(k0 + 4 * q + i, k_last) * M + mcl
                    d = u32(u32(base + u32(a)) & u32(15))
                    a16 = a - types.int64(d)
                    x0, x1, x2, x3 = ld_v4_at(data, a16)
                    x4, x5, x6, x7 = ld_v4_at(data, a16 + 16)
                    raw[i, 0] = x0
                    raw[i, 1] = x1
                    raw[i, 2] = x2
                    raw[i, 3] = x3
                    raw[i, 4] = x4
                    raw[i, 5] = x5
                    raw[i, 6] = x6
                    raw[i, 7] = x7
                    shift[i] = d
                for i in range(4):
                    w0, w1, w2, w3 = shifted_chunk(raw[i, 0], raw[i, 1], raw[i, 2], raw[i, 3],
                                                   raw[i, 4], raw[i, 5], raw[i, 6], raw[i, 7],
                                                   shift[i])
                    rows[i, 0] = w0
                    rows[i, 1] = w1
                    rows[i, 2] = w2
                    rows[i, 3] = w3
            else:
                for i in range(4):
                    k = k0 + 4 * q + i
                    w0 = w1 = w2 = w3 = u32(0)
                    if k < K and mc < M:
                        a = k * M + mc
                        d = u32(u32(base + u32(a)) & u32(15))
                        w0, w1, w2, w3 = ld_edge16(data, a, d, nvalid, total)
                    rows[i, 0] = w0
                    rows[i, 1] = w1
                    rows[i, 2] = w2
                    rows[i, 3] = w3
            kp = k0 + part * E
            if B1D:
                if kp < K:
                    for e in range(E):
                        fac[e] = sinv[cuda.blockIdx.x * ld + kp + e]
            else:
                fac[0] = sinv[(k0 >> 7) * ld + cuda.blockIdx.x]
            for w in range(4):
                t0, t1, t2, t3 = transpose_bytes_4x4(rows[0, w], rows[1, w], rows[2, w],
                                                     rows[3, w])
                tm = u32(16 * c + 4 * w)
                tb[tm, q] = t0
                tb[u32(tm + 1), q] = t1
                tb[u32(tm + 2), q] = t2
                tb[u32(tm + 3), q] = t3
            cuda.syncthreads()
            if kp < K:
                mm = r
                m = m0 + r
                off = m * K + kp                # element offset of the piece in out
                for it in range(T // RSTEP):
                    if m < M:
                        w0 = tb[mm, wcol]
                        w1 = tb[mm, u32(wcol + (NWD - 1))]
                        if B1D:
                            u0, u1, u2, u3 = convert(w0, w1, fac[0], fac[1], fac[2], fac[3],
                                                     fac[4 % E], fac[5 % E], fac[6 % E],
                                                     fac[7 % E])
                        else:
                            f = fac[0]
                            u0, u1, u2, u3 = convert(w0, w1, f, f, f, f, f, f, f, f)
                        store(out, off * OSZ, u0, u1, u2, u3)
                    mm = u32(mm + RSTEP)
                    m += RSTEP
                    off += RSTEP * K
            cuda.syncthreads()      # the next tile overwrites tb
            k0 += cuda.gridDim.y * T

    return kernel


# ------------------------------------------------------------------------------------------
# scalar kernel: any shape and alignment


def _make_scalar_pyfunc(spec):
    decode4 = fp8x4_f32(spec.e4m3)   # the vector paths' hardware decoder, on one byte
    TRANSPOSED = transposed(spec)
    RK = spec.recipe
    columnwise = spec.columnwise
    out_kind = spec.out_kind

    def kernel(data, sinv, out, M, K, ld):
        """Thread (x, y) of the grid handles output element (m, k); x runs along M for the
        transposed sources (coalesced byte reads), else along K; grid rows loop past
        MAX_GRID_Y."""
        a = cuda.blockIdx.x * BX + cuda.threadIdx.x
        b = cuda.blockIdx.y * BY + cuda.threadIdx.y
        along = M if TRANSPOSED else K
        across = K if TRANSPOSED else M
        if a >= along:
            return
        while b < across:
            if TRANSPOSED:
                m, k = a, b
                v = decode4(types.uint32(data[k * M + m]))[0]
            else:
                m, k = b, a
                v = decode4(types.uint32(data[m * K + k]))[0]
            if RK == BLOCK1D:
                if columnwise:
                    f = sinv[(m >> 7) * ld + k]
                else:
                    f = sinv[(k >> 7) * ld + m]
            elif RK == BLOCK2D:
                if columnwise:
                    f = sinv[(k >> 7) * ld + (m >> 7)]
                else:
                    f = sinv[(m >> 7) * ld + (k >> 7)]
            else:
                if columnwise:
                    f = e8m0_factor(sinv[(m >> 5) * ld + k])
                else:
                    f = e8m0_factor(sinv[m * ld + (k >> 5)])
            y = qnan_f32(v * f)
            if out_kind == F32_OUT:
                out[m * K + k] = y
            elif out_kind == BF16_OUT:
                out[m * K + k] = f32_bf16_bits(y)
            else:
                out[m * K + k] = f32_f16_bits(y)
            b += cuda.gridDim.y * BY

    return kernel


# ------------------------------------------------------------------------------------------
# Specializations


def make_kernel_pyfunc(spec):
    """The Python kernel function for `spec` (compile it with :func:`argtypes`)."""
    if spec.path == ROWS:
        return _make_rows_pyfunc(spec)
    if spec.path == TILES:
        return _make_tiles_pyfunc(spec)
    return _make_scalar_pyfunc(spec)


def argtypes(spec):
    """Numba argument types of the kernel for `spec`: data, sinv, out pointers, M, K, ld[,
    lpr_shift]."""
    i64t = types.int64
    if spec.path == SCALAR:
        sinv_t = types.uint8 if spec.recipe == MX else types.float32
        out_t = types.float32 if spec.out_kind == F32_OUT else types.uint16
        return (ptr(types.uint8), ptr(sinv_t), ptr(out_t), i64t, i64t, i64t)
    if spec.recipe != MX:
        sinv_t = types.float32
    else:
        sinv_t = types.uint32 if spec.columnwise else types.uint8
    data_t = types.uint8 if spec.path == TILES and not spec.aligned else types.uint32
    args = (ptr(data_t), ptr(sinv_t), ptr(types.uint32), i64t, i64t, i64t)
    return args + ((i64t,) if spec.path == ROWS else ())


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for `spec` (``_cache`` compiles it)."""
    return make_kernel_pyfunc(spec), argtypes(spec), launch_bounds(spec)
