"""One tiled quantize kernel, specialized per recipe, direction, input dtype and alignment.

A CTA of 256 threads owns a TM x TK tile of the (M, K) input and reads it once, in 16-byte
chunks (VE elements: 4 fp32 or 8 bf16/fp16). Thread t owns chunk column ``c = t % CPR``
(CPR = TK / VE chunks per tile row) in NJ rows: rows come in quads of 4 consecutive rows,
``row(j) = (j // 4) * 4 * RPI + 4 * s + j % 4`` with ``s = t // CPR`` and RPI = 256 / CPR, so
that a thread can pack one byte from each of 4 consecutive rows into a word for the
transposed outputs. All NJ loads are issued before any use.

From the registers it derives whatever the recipe needs in the same pass:
  * row blocks (1x128 Block1D, 1x32 MXFP8): in-thread max over the chunk, then an xor-shuffle
    max over the G = RB / VE lanes of a block;
  * column blocks (128x1 Block1D, 32x1 MXFP8; TM equals the block height): in-thread max over
    the thread's rows, xor shuffles across the lanes of the same chunk column, then a
    cross-warp max in shared memory; threads t < TK turn column t's amax into its scale;
  * tiles (Block2D, TM = TK = 128): one max over everything;
then casts and stores rowwise bytes directly (8- or 4-byte stores), columnwise bytes either
directly (MXFP8, same layout as rowwise) or transposed through a shared-memory tile of
32-bit words (Block1D/Block2D (K, M) outputs, 16-byte stores along M).

Arguments (raw pointers; unused ones may be any pointer): x, row_data, row_sinv, col_data,
col_sinv, M, K. Grid: (cdiv(M, TM), cdiv(K, TK)). Scale padding is written by all CTAs
(grid-stride over the padding entries).
"""
from __future__ import annotations

from collections import namedtuple
from functools import lru_cache

import numpy as np

from . import _device as dev
from ._numba import (SIM, compile_kernel, cuda, device, fmax32, group_fmax, ld_v4, pack4_fp8, ptr,
                     st_v2, st_v4, types)

THREADS = 256
WARPS = THREADS // 32

# recipe kinds
BLOCK1D, BLOCK2D, MXFP8 = "block1d", "block2d", "mxfp8"

QuantSpec = namedtuple("QuantSpec", [
    "recipe",       # BLOCK1D | BLOCK2D | MXFP8
    "kind",         # dev.F32 | dev.BF16 | dev.F16
    "e4m3",         # bool
    "rowwise",      # bool
    "columnwise",   # bool
    "pow2",         # bool (fp32-scale recipes)
    "eps",          # float (fp32-scale recipes)
    "vmax",         # float: the input dtype's max (scale when F/amax overflows)
    "vec",          # bool: K % VE == 0 (16-byte loads, 8/4-byte stores along K)
    "col_vec",      # bool: M % 16 == 0 (16-byte stores of transposed bytes along M)
])


def tile_shape(spec):
    """(TM, TK) of the tile a CTA owns."""
    ve = dev.ELEMS_PER_CHUNK[spec.kind]
    if spec.recipe == BLOCK2D or (spec.recipe == BLOCK1D and spec.columnwise):
        return 128, 128
    if spec.recipe == BLOCK1D:
        return (64 if ve == 8 else 32), 128
    if spec.columnwise:  # MXFP8 with 32x1 blocks: the tile is one block tall
        return 32, (256 if ve == 8 else 128)
    return (64 if ve == 8 else 32), 128


def argtypes(spec):
    """Numba argument types of the kernel for `spec`."""
    in_t = types.uint32 if (spec.vec or spec.kind == dev.F32) else types.uint16
    data_t = types.uint32 if spec.vec else types.uint8
    sinv_t = types.uint8 if spec.recipe == MXFP8 else types.float32
    col_t = types.uint32 if (spec.recipe == MXFP8 and spec.vec) or (
        spec.recipe != MXFP8 and spec.col_vec) else types.uint8
    return (ptr(in_t), ptr(data_t), ptr(sinv_t), ptr(col_t), ptr(sinv_t), types.int64,
            types.int64)


def make_kernel_pyfunc(spec):
    """The Python kernel function for `spec` (compile it with :func:`argtypes`)."""
    VE = dev.ELEMS_PER_CHUNK[spec.kind]
    KIND = spec.kind
    TM, TK = tile_shape(spec)
    CPR = TK // VE
    RPI = THREADS // CPR
    NJ = TM // RPI
    NQ = NJ // 4
    assert NJ % 4 == 0 and CPR <= 32
    IS_MX = spec.recipe == MXFP8
    IS_2D = spec.recipe == BLOCK2D
    ROW = spec.rowwise
    COL = spec.columnwise
    VEC = spec.vec
    COLVEC = spec.col_vec
    # Row blocks (Block1D 1x128, MXFP8 1x32); not used by Block2D.
    RB = 0 if IS_2D else (32 if IS_MX else 128)
    ROWRED = ROW and not IS_2D
    G = RB // VE if ROWRED else 1                # lanes per row block
    COLRED = COL and not IS_2D                   # per-column amax over the tile's rows
    TRANS = COL and not IS_MX                    # (K, M) transposed columnwise output
    TKT, TMW = (TK, TM // 4 + 1) if TRANS else (1, 1)   # +1 word: conflict-free 16B reads
    TKC = TK if COLRED else 1
    NOUT = (TK * TM // 16) // THREADS if TRANS else 0    # 16-byte stores per thread
    PARTS = TM // 16
    NAN_WORD = np.uint32(dev.NAN_WORD[KIND])
    NAN_HALF = dev.NAN_HALF.get(KIND, 0)
    ONE = np.float32(1.0)
    ZERO = np.float32(0.0)  # amax is fmaxf from 0 (NaN ignored; an all-NaN block gives 0)

    elem = dev.element_decoder(KIND)
    pack4 = pack4_fp8(spec.e4m3)
    if IS_MX:
        rule = dev.e8m0_rule(448.0 if spec.e4m3 else 57344.0)
    else:
        rule = dev.fp32_scale_rule(448.0 if spec.e4m3 else 57344.0, spec.pow2, spec.eps,
                                   spec.vmax)
    fill_padding = dev.fill_padding
    store_unaligned = dev.store_tile_rows_unaligned
    float32, uint32 = types.float32, types.uint32

    @device
    def store_chunk(out, raw, j, r, kc, M, K, scl):
        """Cast chunk j (row r, columns kc..kc+VE-1) with per-element multipliers scl[e] and
        store its VE bytes at out[r, kc:] of an (M, K) byte array."""
        words = cuda.local.array(2, uint32)
        for h in range(VE // 4):
            e = 4 * h
            words[h] = pack4(elem(raw, j, e) * scl[e], elem(raw, j, e + 1) * scl[e + 1],
                             elem(raw, j, e + 2) * scl[e + 2], elem(raw, j, e + 3) * scl[e + 3])
        if VEC:
            if r < M and kc < K:
                if VE == 8:
                    st_v2(out, (r * K + kc) // 4, words[0], words[1])
                else:
                    out[(r * K + kc) // 4] = words[0]
        else:
            for e in range(VE):
                if r < M and kc + e < K:
                    out[r * K + kc + e] = (words[e // 4] >> (8 * (e % 4))) & 0xFF

    def kernel(x, rdata, rsinv, cdata, csinv, M, K):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        bm = cuda.blockIdx.x
        bk = cuda.blockIdx.y
        m0 = bm * TM
        k0 = bk * TK
        c = tid % CPR
        s = tid // CPR
        kc = k0 + c * VE
        red = cuda.shared.array(THREADS, float32)        # simulator shuffle scratch
        wred = cuda.shared.array(WARPS, float32)
        colred = cuda.shared.array((WARPS, TKC), float32)
        colscale = cuda.shared.array(TKC, float32)
        tb = cuda.shared.array((TKT, TMW), uint32)

        # ---- scale padding (DESIGN §4), spread over all CTAs
        gtid = (bk * cuda.gridDim.x + bm) * THREADS + tid
        gsize = cuda.gridDim.x * cuda.gridDim.y * THREADS
        if IS_MX:
            if ROW:
                fill_padding(rsinv, M, K // 32, (M + 127) // 128 * 128, (K // 32 + 3) // 4 * 4,
                             np.uint8(0), gtid, gsize)
            if COL:
                fill_padding(csinv, M // 32, K, (M // 32 + 3) // 4 * 4, (K + 127) // 128 * 128,
                             np.uint8(0), gtid, gsize)
        elif IS_2D:
            nmt = (M + 127) // 128
            nkt = (K + 127) // 128
            if ROW:
                fill_padding(rsinv, nmt, nkt, nmt, (nkt + 3) // 4 * 4, ONE, gtid, gsize)
            if COL:
                fill_padding(csinv, nkt, nmt, nkt, (nmt + 3) // 4 * 4, ONE, gtid, gsize)
        else:
            if ROW:
                nkb = (K + 127) // 128
                fill_padding(rsinv, nkb, M, nkb, (M + 3) // 4 * 4, ONE, gtid, gsize)
            if COL:
                nmb = (M + 127) // 128
                fill_padding(csinv, nmb, K, nmb, (K + 3) // 4 * 4, ONE, gtid, gsize)

        # ---- load the tile: NJ chunks per thread, all loads before any use
        raw = cuda.local.array((NJ, 4), uint32)
        for j in range(NJ):
            r = m0 + (j // 4) * 4 * RPI + 4 * s + (j % 4)
            if VEC:
                if r < M and kc < K:
                    w0, w1, w2, w3 = ld_v4(x, (r * K + kc) // (VE // 4))
                    raw[j, 0] = w0
                    raw[j, 1] = w1
                    raw[j, 2] = w2
                    raw[j, 3] = w3
                else:
                    for w in range(4):
                        raw[j, w] = NAN_WORD
            else:
                if KIND == dev.F32:
                    for e in range(4):
                        if r < M and kc + e < K:
                            raw[j, e] = x[r * K + kc + e]
                        else:
                            raw[j, e] = NAN_WORD
                else:
                    for w in range(4):
                        lo = NAN_HALF
                        hi = NAN_HALF
                        if r < M and kc + 2 * w < K:
                            lo = x[r * K + kc + 2 * w]
                        if r < M and kc + 2 * w + 1 < K:
                            hi = x[r * K + kc + 2 * w + 1]
                        raw[j, w] = uint32(lo) | (uint32(hi) << 16)

        # ---- amaxes and scales
        rscale = cuda.local.array(NJ, float32)
        cscale = cuda.local.array(VE, float32)
        if IS_2D:
            t = ZERO
            for j in range(NJ):
                for e in range(VE):
                    t = fmax32(t, abs(elem(raw, j, e)))
            t = group_fmax(t, 1, 16, red, tid)
            if lane == 0:
                wred[warp] = t
            cuda.syncthreads()
            t = wred[0]
            for w in range(1, WARPS):
                t = fmax32(t, wred[w])
            sc, sinv = rule(t)
            for j in range(NJ):
                rscale[j] = sc
            for e in range(VE):
                cscale[e] = sc
            if tid == 0:
                nmt = (M + 127) // 128
                nkt = (K + 127) // 128
                if ROW:
                    rsinv[bm * ((nkt + 3) // 4 * 4) + bk] = sinv
                if COL:
                    csinv[bk * ((nmt + 3) // 4 * 4) + bm] = sinv
        if ROWRED:
            for j in range(NJ):
                a = ZERO
                for e in range(VE):
                    a = fmax32(a, abs(elem(raw, j, e)))
                a = group_fmax(a, 1, G // 2, red, tid)
                r = m0 + (j // 4) * 4 * RPI + 4 * s + (j % 4)
                if IS_MX:
                    code, mult = rule(a)
                    rscale[j] = mult
                    if c % G == 0 and r < M and kc < K:
                        rsinv[r * ((K // 32 + 3) // 4 * 4) + kc // 32] = code
                else:
                    sc, sinv = rule(a)
                    rscale[j] = sc
                    if c == 0 and r < M:
                        rsinv[bk * ((M + 3) // 4 * 4) + r] = sinv
        if COLRED:
            cam = cuda.local.array(VE, float32)
            for e in range(VE):
                a = ZERO
                for j in range(NJ):
                    a = fmax32(a, abs(elem(raw, j, e)))
                if CPR < 32:
                    a = group_fmax(a, CPR, 16, red, tid)
                cam[e] = a
            if lane < CPR:
                for e in range(VE):
                    colred[warp, c * VE + e] = cam[e]
            cuda.syncthreads()
            if tid < TK:
                a = colred[0, tid]
                for w in range(1, WARPS):
                    a = fmax32(a, colred[w, tid])
                k = k0 + tid
                if IS_MX:
                    code, mult = rule(a)
                    colscale[tid] = mult
                    if k < K:
                        csinv[bm * ((K + 127) // 128 * 128) + k] = code
                else:
                    sc, sinv = rule(a)
                    colscale[tid] = sc
                    if k < K:
                        csinv[bm * ((K + 3) // 4 * 4) + k] = sinv
            cuda.syncthreads()
            for e in range(VE):
                cscale[e] = colscale[c * VE + e]

        # ---- rowwise bytes (and MXFP8 columnwise bytes, same layout)
        if ROW:
            rs = cuda.local.array(VE, float32)
            for j in range(NJ):
                for e in range(VE):
                    rs[e] = rscale[j]
                store_chunk(rdata, raw, j, m0 + (j // 4) * 4 * RPI + 4 * s + (j % 4), kc, M, K,
                            rs)
        if COL and IS_MX:
            for j in range(NJ):
                store_chunk(cdata, raw, j, m0 + (j // 4) * 4 * RPI + 4 * s + (j % 4), kc, M, K,
                            cscale)

        # ---- transposed columnwise bytes through shared memory
        if TRANS:
            for q in range(NQ):
                for e in range(VE):
                    sc = cscale[e]
                    tb[c * VE + e, q * RPI + s] = pack4(
                        elem(raw, 4 * q, e) * sc, elem(raw, 4 * q + 1, e) * sc,
                        elem(raw, 4 * q + 2, e) * sc, elem(raw, 4 * q + 3, e) * sc)
            cuda.syncthreads()
            if COLVEC:
                for it in range(NOUT):
                    u = tid + THREADS * it
                    kk = u // PARTS
                    part = u % PARTS
                    k = k0 + kk
                    mm = m0 + part * 16
                    if k < K and mm < M:
                        st_v4(cdata, (k * M + mm) // 4, tb[kk, part * 4], tb[kk, part * 4 + 1],
                              tb[kk, part * 4 + 2], tb[kk, part * 4 + 3])
            else:
                # rows of (K, M) are not 16-byte aligned: 4-byte words, bytes at the ends
                store_unaligned(tb, cdata, k0, m0, K, M, TK, TM, tid, THREADS)

    return kernel


# Benchmark knob: minimum resident CTAs per SM passed to the compiler (None: let it choose).
MIN_BLOCKS_PER_SM = None


def default_min_blocks(spec):
    """Minimum CTAs per SM for the register allocator, chosen from the H200 sweep
    (bench/NOTES.md): capping registers pays for the Block1D kernels with columnwise output."""
    if spec.recipe == BLOCK1D and spec.columnwise and spec.kind != dev.F32:
        return 4 if spec.rowwise else 3
    return None


def get_kernel(spec):
    """Compiled, launchable kernel for `spec` (see ``_numba.compile_kernel``)."""
    min_blocks = MIN_BLOCKS_PER_SM if MIN_BLOCKS_PER_SM is not None else \
        default_min_blocks(spec)
    return _get_kernel(spec, min_blocks)


@lru_cache(maxsize=None)
def _get_kernel(spec, min_blocks):
    bounds = THREADS if min_blocks is None else (THREADS, min_blocks)
    return compile_kernel(make_kernel_pyfunc(spec), argtypes(spec),
                          launch_bounds=None if SIM else bounds)


def grid(spec, rows, cols):
    tm, tk = tile_shape(spec)
    return (-(-rows // tm), -(-cols // tk), 1)
