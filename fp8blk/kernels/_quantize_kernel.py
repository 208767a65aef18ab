"""One tiled quantize kernel, specialized per recipe, direction, input dtype and alignment.

Builder (launcher: ``quantize``): the kernel is generated from a ``_specs.QuantizeSpec`` alone
(every tuning value is a spec field). A CTA of NT = ``spec.threads`` threads (256 by default;
the fused Block1D row+col kernel on 2-byte inputs and the Block2D row kernel can take 512) owns a TM x TK tile of the (M, K) input and reads it once, in 16-byte
chunks (VE elements: 4 fp32 or 8 bf16/fp16). Thread t owns chunk column ``c = t % CPR``
(CPR = TK / VE chunks per tile row) in NJ rows: rows come in quads of 4 consecutive rows,
``row(j) = (j // 4) * 4 * RPI + 4 * s + j % 4`` with ``s = t // CPR`` and RPI = NT / CPR, so
that a thread can pack one byte from each of 4 consecutive rows into a word for the
transposed outputs. All NJ loads are issued before any use.

From the registers it derives whatever the recipe needs in the same pass:
  * row blocks (1x128 Block1D, 1x32 MXFP8): in-thread max over the chunk (2-byte inputs: packed
    ``max.xorsign.abs.bf16x2/f16x2``, one instruction per 2 elements), then a reduce-scatter
    over the G = RB / VE lanes of a block, so that each lane owns one chunk's block amax and
    runs the scale rule once (not once per chunk); the multipliers are gathered back with
    indexed shuffles where the rowwise bytes are cast;
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

Group (``_specs.QuantizeGroupSpec``, launcher: ``quantize.quantize_group`` / ``group_site``):
the work of 2 or 3 variants, each on its own input and outputs, in one launch. The tile's
work is one device function (:func:`make_body`) that takes its tile and its share of the
padding instead of reading blockIdx / gridDim; the group kernel gives CTA b of a 1-D grid
the tile its part's single kernel gives CTA (b % gx, b // gx), b counted from the part's
first CTA, and the padding strided over that part's CTAs. A block's bytes and scale depend
on its values alone and the padding on the shape alone, so each output is byte for byte the
single kernel's. Arguments: each part's five pointers in turn, then each part's M, K.
"""
from __future__ import annotations

import numpy as np

from . import _kernel_lib as dev
from . import _specs as sp
from ._specs import BLOCK2D, MXFP8, SIM
from ._specs import quantize_tile as tile_shape
from ._numba import (absmax_bf16x2, absmax_f16x2, cuda, device, fmax32,
                     group_fmax, pack4_fp8, ptr, shfl_idx_f32, shfl_xor_f32, st_u32_at,
                     st_v2_at, types)

def argtypes(spec):
    """Numba argument types of the kernel for `spec`."""
    in_t = types.uint32 if (spec.vec or spec.kind == sp.F32) else types.uint16
    data_t = types.uint32 if spec.vec else types.uint8
    sinv_t = types.uint8 if spec.recipe == MXFP8 else types.float32
    col_t = types.uint32 if (spec.recipe == MXFP8 and spec.vec) or (
        spec.recipe != MXFP8 and spec.col_vec) else types.uint8
    return (ptr(in_t), ptr(data_t), ptr(sinv_t), ptr(col_t), ptr(sinv_t), types.int64,
            types.int64)


def _tile_function(fn):
    """The tile's work as a device function of its own, inlined by NVVM (``forceinline``)
    rather than copied into each caller's IR by Numba (``inline="always"``, as the small
    helpers are): Numba's IR copy of a function this size doubled a kernel's compile time."""
    if SIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def make_body(spec):
    """The kernel's work for one tile, a device function (the single kernel and the group
    kernel map their CTAs onto tiles and call it)."""
    VE = sp.ELEMS_PER_CHUNK[spec.kind]
    KIND = spec.kind
    NT = spec.threads
    NW = NT // 32
    TM, TK = tile_shape(spec)
    CPR = TK // VE
    RPI = NT // CPR
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
    LOG_G = G.bit_length() - 1
    LOG_NJ = NJ.bit_length() - 1
    # reduce-scatter of the NJ row amaxes over the G lanes of a block (needs NJ <= G)
    SCATTER = ROWRED and spec.row_scatter and NJ <= G
    COLRED = COL and not IS_2D                   # per-column amax over the tile's rows
    TRANS = COL and not IS_MX                    # (K, M) transposed columnwise output
    NAN_WORD = np.uint32(sp.NAN_WORD[KIND])
    NAN_HALF = sp.NAN_HALF.get(KIND, 0)
    ONE = np.float32(1.0)
    ZERO = np.float32(0.0)  # amax is fmaxf from 0 (NaN ignored; an all-NaN block gives 0)
    ISZ = sp.ITEMSIZE[KIND]                     # bytes per input element
    PACKED = spec.packed_amax and KIND != sp.F32 and (ROWRED or COLRED)
    habsmax2 = absmax_bf16x2 if KIND == sp.BF16 else absmax_f16x2   # max(|a|, |b|) per half
    word_f32 = dev.word_decoder(KIND)

    @device
    def roff(j):
        """Row of chunk j relative to the thread's first row m0 + 4 s."""
        return (j // 4) * (4 * RPI) + (j % 4)

    elem = dev.element_decoder(KIND)
    pack4 = pack4_fp8(spec.e4m3)
    if IS_MX:
        rule = dev.e8m0_rule(448.0 if spec.e4m3 else 57344.0)
    else:
        rule = dev.fp32_scale_rule(448.0 if spec.e4m3 else 57344.0, spec.pow2, spec.eps,
                                   spec.vmax)
    fill_padding = dev.fill_padding
    ld_v4_at_or = dev.ld_v4_at_or
    store_tile = dev.tile_storer(TK, TM, NT, COLVEC) if TRANS else None
    float32, uint32 = types.float32, types.uint32

    @device
    def scatter_lane(lane, j):
        """Lane of this lane's row-block group that holds chunk j's block amax after the
        reduce-scatter (its lane bits G/2, G/4, ... spell j's bits, high to low)."""
        src = lane & (32 - G)
        for k in range(LOG_NJ):
            if (j & (NJ >> (k + 1))) != 0:
                src |= G >> (k + 1)
        return src

    @device
    def chunk_absmax(raw, j):
        """max(0, |x|) over the VE elements of chunk j (NaN ignored)."""
        if PACKED:
            t = habsmax2(habsmax2(raw[j, 0], raw[j, 1]), habsmax2(raw[j, 2], raw[j, 3]))
            lo, hi = word_f32(t)
            return fmax32(fmax32(ZERO, abs(lo)), abs(hi))
        a = ZERO
        for e in range(VE):
            a = fmax32(a, abs(elem(raw, j, e)))
        return a

    @device
    def store_chunk(out, raw, j, row_ok, eidx, K, kc, scl):
        """Cast chunk j (flat element index eidx = r * K + kc of its first element) with
        per-element multipliers scl[e] and store its VE bytes at out[r, kc:] of an (M, K) byte
        array (row_ok: r < M)."""
        words = cuda.local.array(2, uint32)
        for h in range(VE // 4):
            e = 4 * h
            words[h] = pack4(elem(raw, j, e) * scl[e], elem(raw, j, e + 1) * scl[e + 1],
                             elem(raw, j, e + 2) * scl[e + 2], elem(raw, j, e + 3) * scl[e + 3])
        if VEC:
            if row_ok and kc < K:
                if VE == 8:
                    st_v2_at(out, eidx, words[0], words[1])
                else:
                    st_u32_at(out, eidx, words[0])
        else:
            for e in range(VE):
                if row_ok and kc + e < K:
                    out[eidx + e] = (words[e // 4] >> (8 * (e % 4))) & 0xFF

    @_tile_function
    def body(x, rdata, rsinv, cdata, csinv, M, K, bm, bk, gtid, gsize, red, wred, colred,
             colscale, tb):
        """Tile (bm, bk) of the (M, K) input; this thread is `gtid` of the `gsize` threads
        that share the scale padding's fill; the shared arrays are :func:`shared_shapes`'
        (or larger)."""
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        m0 = bm * TM
        k0 = bk * TK
        c = tid % CPR
        s = tid // CPR
        kc = k0 + c * VE
        r0 = m0 + 4 * s                 # row of chunk 0; chunk j is row r0 + roff(j)
        e0 = r0 * K + kc                # flat element index of chunk 0

        # ---- scale padding (docs/layouts.md), spread over all CTAs
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
            r = r0 + roff(j)
            ej = e0 + roff(j) * K
            if VEC:
                w0, w1, w2, w3 = ld_v4_at_or(x, ej * ISZ, r < M and kc < K, NAN_WORD)
                raw[j, 0] = w0
                raw[j, 1] = w1
                raw[j, 2] = w2
                raw[j, 3] = w3
            else:
                if KIND == sp.F32:
                    for e in range(4):
                        if r < M and kc + e < K:
                            raw[j, e] = x[ej + e]
                        else:
                            raw[j, e] = NAN_WORD
                else:
                    for w in range(4):
                        lo = NAN_HALF
                        hi = NAN_HALF
                        if r < M and kc + 2 * w < K:
                            lo = x[ej + 2 * w]
                        if r < M and kc + 2 * w + 1 < K:
                            hi = x[ej + 2 * w + 1]
                        raw[j, w] = uint32(lo) | (uint32(hi) << 16)

        # ---- amaxes and scales
        rscale = cuda.local.array(NJ, float32)
        rmult = ONE
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
            for w in range(1, NW):
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
        if ROWRED and SCATTER:
            # In-thread maxima of the NJ chunks, then a reduce-scatter over the G lanes of a
            # row block: at each step a lane keeps half of its values and sends the other half
            # to its partner, so after log2(NJ) steps it holds the block amax of one chunk
            # (jsel); plain xor steps finish the remaining lane bits. Each lane then runs the
            # scale rule once, and the multipliers are gathered back per chunk.
            ra = cuda.local.array(NJ, float32)
            for j in range(NJ):
                ra[j] = chunk_absmax(raw, j)
            for k in range(LOG_NJ):
                half = NJ >> (k + 1)
                up = (lane & (G >> (k + 1))) != 0
                for i in range(half):
                    lo_v = ra[i]
                    hi_v = ra[i + half]
                    send = lo_v if up else hi_v
                    keep = hi_v if up else lo_v
                    ra[i] = fmax32(keep, shfl_xor_f32(send, G >> (k + 1), red, tid))
            a = ra[0]
            for k in range(LOG_NJ, LOG_G):
                a = fmax32(a, shfl_xor_f32(a, G >> (k + 1), red, tid))
            jsel = 0
            for k in range(LOG_NJ):
                if (lane & (G >> (k + 1))) != 0:
                    jsel += NJ >> (k + 1)
            r = r0 + (jsel // 4) * (4 * RPI) + (jsel % 4)
            owner = (lane & ((G >> LOG_NJ) - 1)) == 0
            if IS_MX:
                code, mult = rule(a)
                if owner and r < M and kc < K:
                    rsinv[r * ((K // 32 + 3) // 4 * 4) + kc // 32] = code
            else:
                mult, sinv = rule(a)
                if owner and r < M:
                    rsinv[bk * ((M + 3) // 4 * 4) + r] = sinv
            rmult = mult    # chunk j's multiplier is gathered from lane scatter_lane(j) at use
        elif ROWRED:
            for j in range(NJ):
                a = chunk_absmax(raw, j)
                a = group_fmax(a, 1, G // 2, red, tid)
                r = r0 + roff(j)
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
            if PACKED:
                for w in range(4):
                    t = raw[0, w]
                    for j in range(1, NJ):
                        t = habsmax2(t, raw[j, w])
                    lo, hi = word_f32(t)
                    cam[2 * w] = fmax32(ZERO, abs(lo))
                    cam[2 * w + 1] = fmax32(ZERO, abs(hi))
            else:
                for e in range(VE):
                    a = ZERO
                    for j in range(NJ):
                        a = fmax32(a, abs(elem(raw, j, e)))
                    cam[e] = a
            for e in range(VE):
                a = cam[e]
                if CPR < 32:
                    a = group_fmax(a, CPR, 16, red, tid)
                cam[e] = a
            if lane < CPR:
                for e in range(VE):
                    colred[warp, c * VE + e] = cam[e]
            cuda.syncthreads()
            if tid < TK:
                a = colred[0, tid]
                for w in range(1, NW):
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
                if SCATTER:
                    sc = shfl_idx_f32(rmult, scatter_lane(lane, j), red, tid)
                else:
                    sc = rscale[j]
                for e in range(VE):
                    rs[e] = sc
                store_chunk(rdata, raw, j, r0 + roff(j) < M, e0 + roff(j) * K, K, kc, rs)
        if COL and IS_MX:
            for j in range(NJ):
                store_chunk(cdata, raw, j, r0 + roff(j) < M, e0 + roff(j) * K, K, kc, cscale)

        # ---- transposed columnwise bytes through shared memory
        if TRANS:
            for q in range(NQ):
                for e in range(VE):
                    sc = cscale[e]
                    tb[c * VE + e, q * RPI + s] = pack4(
                        elem(raw, 4 * q, e) * sc, elem(raw, 4 * q + 1, e) * sc,
                        elem(raw, 4 * q + 2, e) * sc, elem(raw, 4 * q + 3, e) * sc)
            cuda.syncthreads()
            # rows of (K, M) not 16-byte aligned (not COLVEC): aligned 16-byte chunks, the
            # partial chunks at the row ends with 1/2/4/8-byte stores
            store_tile(tb, cdata, k0, m0, K, M, tid)

    return body


def shared_shapes(spec):
    """Shapes of the body's shared arrays for `spec`: red (NT,) and wred (NW,) float32,
    colred (NW, TKC) and colscale (TKC,) float32, tb (TKT, TMW) uint32 (size-1 dims where
    the variant does not use an array)."""
    NT = spec.threads
    TM, TK = tile_shape(spec)
    COLRED = spec.columnwise and spec.recipe != BLOCK2D
    TRANS = spec.columnwise and spec.recipe != MXFP8
    TKC = TK if COLRED else 1
    TKT, TMW = (TK, TM // 4 + 1) if TRANS else (1, 1)   # +1 word: conflict-free 16B reads
    return {"red": NT, "wred": NT // 32, "colred": (NT // 32, TKC), "colscale": TKC,
            "tb": (TKT, TMW)}


def make_kernel_pyfunc(spec):
    """The Python kernel function for `spec` (compile it with :func:`argtypes`): grid
    (cdiv(M, TM), cdiv(K, TK)), one tile per CTA, the padding strided over all CTAs."""
    body = make_body(spec)
    NT = spec.threads
    shp = shared_shapes(spec)
    RED, WRED, COLRED, COLSCALE, TB = (shp[k] for k in ("red", "wred", "colred", "colscale",
                                                         "tb"))
    float32, uint32 = types.float32, types.uint32

    def kernel(x, rdata, rsinv, cdata, csinv, M, K):
        bm = cuda.blockIdx.x
        bk = cuda.blockIdx.y
        red = cuda.shared.array(RED, float32)        # simulator shuffle scratch
        wred = cuda.shared.array(WRED, float32)
        colred = cuda.shared.array(COLRED, float32)
        colscale = cuda.shared.array(COLSCALE, float32)
        tb = cuda.shared.array(TB, uint32)
        gtid = (bk * cuda.gridDim.x + bm) * NT + cuda.threadIdx.x
        gsize = cuda.gridDim.x * cuda.gridDim.y * NT
        body(x, rdata, rsinv, cdata, csinv, M, K, bm, bk, gtid, gsize, red, wred, colred,
             colscale, tb)

    return kernel


def launch_bounds(spec):
    """Launch bounds of the kernel: max threads per CTA, and min resident CTAs per SM when the
    spec caps registers."""
    return spec.threads if spec.min_blocks is None else (spec.threads, spec.min_blocks)


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for `spec` (``_cache`` compiles it)."""
    return make_kernel_pyfunc(spec), argtypes(spec), launch_bounds(spec)


# ---- group: several quantize variants' work in one launch ----------------------------------


def group_argtypes(gspec):
    """Numba argument types of the group kernel for `gspec` (a ``QuantizeGroupSpec``): each
    part's five pointers in :func:`argtypes`' order (x, row_data, row_sinv, col_data,
    col_sinv), part after part, then each part's (M, K)."""
    each = [argtypes(p) for p in gspec.parts]
    return tuple(t for a in each for t in a[:5]) + tuple(t for a in each for t in a[5:])


def part_runner(spec):
    """``run(x, rdata, rsinv, cdata, csinv, M, K, b, red, wred, colred, colscale, tb) ->
    b - n``: a part of a group, n = its CTA count (its single kernel's grid, cdiv(M, TM) x
    cdiv(K, TK)). CTA b, when 0 <= b < n, does the tile its single kernel's CTA (b % gx,
    b // gx) does, gx = cdiv(M, TM), and its share of the padding fill strided over the
    part's n CTAs; any other b does nothing. The result numbers the CTA in the next part."""
    body = make_body(spec)
    NT = spec.threads
    TM, TK = tile_shape(spec)
    u32, i32, i64 = types.uint32, types.int32, types.int64

    @device
    def run(x, rdata, rsinv, cdata, csinv, M, K, b, red, wred, colred, colscale, tb):
        gx = i64((M + (TM - 1)) // TM)
        n = gx * i64((K + (TK - 1)) // TK)
        if b >= 0 and b < n:
            # 32-bit division: a 64-bit one is a subroutine call, which would cap the whole
            # kernel's registers at the call ABI's 64 (_kernel_lib.fill_padding)
            ub, ugx = u32(b), u32(gx)
            body(x, rdata, rsinv, cdata, csinv, M, K, i32(ub % ugx), i32(ub // ugx),
                 b * NT + cuda.threadIdx.x, n * NT, red, wred, colred, colscale, tb)
        return b - n

    return run


def make_group_kernel_pyfunc(gspec):
    """The group kernel for `gspec` (compile it with :func:`group_argtypes`): a 1-D grid of
    the parts' CTA counts summed, NT = the parts' common ``threads``. A CTA runs one part's
    body, so the parts share one set of shared arrays, each the largest any part needs."""
    parts = gspec.parts
    NT = parts[0].threads
    assert all(p.threads == NT for p in parts) and len(parts) in sp.GROUP_SIZES
    shp = [shared_shapes(p) for p in parts]
    RED, WRED = NT, NT // 32
    TKC = max(s["colscale"] for s in shp)
    COLRED = (WRED, TKC)
    TB = (max(s["tb"][0] for s in shp), max(s["tb"][1] for s in shp))
    float32, uint32 = types.float32, types.uint32
    run0, run1 = part_runner(parts[0]), part_runner(parts[1])

    @device
    def first(x0, rd0, rs0, cd0, cs0, M0, K0):
        """The shared arrays of the group (declared once, inlined into the kernel) and the
        first part's run: (CTA number in the next part, the arrays)."""
        red = cuda.shared.array(RED, float32)        # simulator shuffle scratch
        wred = cuda.shared.array(WRED, float32)
        colred = cuda.shared.array(COLRED, float32)
        colscale = cuda.shared.array(TKC, float32)
        tb = cuda.shared.array(TB, uint32)
        b = run0(x0, rd0, rs0, cd0, cs0, M0, K0, cuda.blockIdx.x, red, wred, colred,
                 colscale, tb)
        return b, red, wred, colred, colscale, tb

    if len(parts) == 2:
        def kernel(x0, rd0, rs0, cd0, cs0, x1, rd1, rs1, cd1, cs1, M0, K0, M1, K1):
            b, red, wred, colred, colscale, tb = first(x0, rd0, rs0, cd0, cs0, M0, K0)
            run1(x1, rd1, rs1, cd1, cs1, M1, K1, b, red, wred, colred, colscale, tb)

        return kernel

    run2 = part_runner(parts[2])

    def kernel3(x0, rd0, rs0, cd0, cs0, x1, rd1, rs1, cd1, cs1, x2, rd2, rs2, cd2, cs2, M0,
                K0, M1, K1, M2, K2):
        b, red, wred, colred, colscale, tb = first(x0, rd0, rs0, cd0, cs0, M0, K0)
        b = run1(x1, rd1, rs1, cd1, cs1, M1, K1, b, red, wred, colred, colscale, tb)
        run2(x2, rd2, rs2, cd2, cs2, M2, K2, b, red, wred, colred, colscale, tb)

    return kernel3


def group_launch_bounds(gspec):
    """Launch bounds of the group kernel: the parts' CTA size, and the group's min CTAs per
    SM where it caps registers."""
    nt = gspec.parts[0].threads
    return nt if gspec.min_blocks is None else (nt, gspec.min_blocks)


def build_group(gspec):
    """(pyfunc, argtypes, launch_bounds) of the group kernel for `gspec`."""
    return make_group_kernel_pyfunc(gspec), group_argtypes(gspec), group_launch_bounds(gspec)
