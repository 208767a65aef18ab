"""Builder of the scale and partial-cast kernels of the master-weight path (launcher,
batch table and address space: ``partial``).

Kernels
-------
* Block2D scales: one thread per entry of the padded (round4(mt), round4(kt)) tile grid of each
  weight: from the reduced tile amax, the fp32 scale (docs/numerics.md with the recipe's fmt / pow2 /
  epsilon read from the table and the model dtype's max as the overflow value) goes to a packed
  scale buffer for the cast, scale_inv to the weight's rowwise and columnwise scale_inv, and
  padding entries get 1.0.
* MXFP8 scales: one thread per byte of each weight's padded scale_inv tensors (rowwise
  (round128(h), round4(w/32)), columnwise (round4(h/32), round128(w))): the reduced code, or 0
  in padding.
* Cast: a CUDA block casts 4096 consecutive elements of one shard; a thread takes groups of 4
  consecutive master elements (one 16-byte load when aligned), rounds them to the model dtype,
  multiplies by their block's scale and packs 4 FP8 bytes, stored as one 32-bit word where
  the destination is aligned (bytes otherwise). The destination of flat element f is
  ``F_ROWDATA + f`` (the weight's data, or the fragment shifted by o). Specializations: with or
  without columnwise output (MXFP8 columnwise data; Block2D transposed data, byte stores) and
  the model dtype; the format, the master dtype and alignment are per-weight runtime flags,
  uniform within a CUDA block.
"""
from __future__ import annotations

import numpy as np

from ._kernel_lib import e8m0_multiplier, fp32_scale
from ._numba import bits_f32, cuda, device, pack4_e4m3, pack4_e5m2, ptr, types
from ._partial_amax_kernel import decode4, load_group, model_rounder, shard_of, weight_of
from ._specs import (CAST_CHUNK, CAST_GROUPS, CAST_THREADS, F_CAST0, F_CASTF0, F_COLBUF,
                           F_COLDATA, F_COLSINV, F_E4M3, F_EPS, F_HASCOL, F_HASROW, F_MVEC,
                           F_NCB, F_NFC, F_POW2, F_ROWBUF, F_ROWDATA, F_ROWSINV, F_SCALE0,
                           SCALE_THREADS)

_ONE = np.float32(1.0)


# ---- scales -------------------------------------------------------------------------------------


def _block2d_scale_pyfunc(vinf):
    VINF = np.float32(vinf)
    E4M3_MAX, E5M2_MAX = np.float32(448.0), np.float32(57344.0)
    uint32 = types.uint32

    def kernel(tab, first, count, total, amax, scales, memf):
        g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if g >= total:
            return
        row, H, W = weight_of(tab, first, count, F_SCALE0, g)
        mt = (H + 127) // 128
        kt = (W + 127) // 128
        mt4 = (mt + 3) // 4 * 4
        kt4 = (kt + 3) // 4 * 4
        e = g - tab[row + F_SCALE0]
        a = uint32(e) // uint32(kt4)
        b = e - a * kt4
        rs = tab[row + F_ROWSINV]
        cs = tab[row + F_COLSINV]
        if a < mt and b < kt:
            fmax = E4M3_MAX if tab[row + F_E4M3] != 0 else E5M2_MAX
            eps = bits_f32(uint32(tab[row + F_EPS]))
            j = tab[row + F_ROWBUF] + a * kt + b
            s = fp32_scale(amax[j], fmax, tab[row + F_POW2] != 0, eps, VINF)
            sinv = _ONE / s
            scales[j] = s
            if rs >= 0:
                memf[rs + a * kt4 + b] = sinv
            if cs >= 0:
                memf[cs + b * mt4 + a] = sinv
        elif a < mt:
            if rs >= 0:
                memf[rs + a * kt4 + b] = _ONE
        elif b < kt:
            if cs >= 0:
                memf[cs + b * mt4 + a] = _ONE

    return kernel


def _mxfp8_scale_pyfunc():
    uint32, uint8 = types.uint32, types.uint8

    def kernel(tab, first, count, total, codes, mem8):
        g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if g >= total:
            return
        row, H, W = weight_of(tab, first, count, F_SCALE0, g)
        e = g - tab[row + F_SCALE0]
        rs = tab[row + F_ROWSINV]
        if rs >= 0:
            wb = W // 32
            wb4 = (wb + 3) // 4 * 4
            n_row = (H + 127) // 128 * 128 * wb4
            if e < n_row:
                r = uint32(e) // uint32(wb4)
                j = e - r * wb4
                v = uint8(0)
                if r < H and j < wb:
                    v = codes[tab[row + F_ROWBUF] + r * wb + j]
                mem8[rs + e] = v
                return
            e -= n_row
        cs = tab[row + F_COLSINV]
        hb = H // 32
        w128 = (W + 127) // 128 * 128
        r = uint32(e) // uint32(w128)
        c = e - r * w128
        v = uint8(0)
        if r < hb and c < W:
            v = codes[tab[row + F_COLBUF] + r * W + c]
        mem8[cs + e] = v

    return kernel


def scale_argtypes(block2d):
    if block2d:
        return (ptr(types.int64), types.int64, types.int64, types.int64, ptr(types.float32),
                ptr(types.float32), ptr(types.float32))
    return (ptr(types.int64), types.int64, types.int64, types.int64, ptr(types.uint8),
            ptr(types.uint8))


def scale_pyfunc(block2d, vinf):
    return _block2d_scale_pyfunc(vinf) if block2d else _mxfp8_scale_pyfunc()


def build_scale(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.PartialScaleSpec``."""
    return scale_pyfunc(spec.block2d, spec.vinf), scale_argtypes(spec.block2d), SCALE_THREADS


# ---- cast ---------------------------------------------------------------------------------------


def _cast_pyfunc(block2d, model, with_col, fast_path):
    rnd = model_rounder(model)
    THREADS = CAST_THREADS
    GROUPS = CAST_GROUPS
    STEP = THREADS * 4  # elements between a thread's consecutive groups
    PREFIX = F_CASTF0 if fast_path else F_CAST0
    uint32, float32 = types.uint32, types.float32

    @device
    def pack(e4m3, a, b, c, d):
        if e4m3:
            return pack4_e4m3(a, b, c, d)
        return pack4_e5m2(a, b, c, d)

    @device
    def store4(mem8, mem32, p, word, n_valid):
        """The 4 bytes of `word` at byte offset p (only the first n_valid of them)."""
        if n_valid == 4 and p % 4 == 0:
            mem32[p // 4] = word
        else:
            for e in range(4):
                if e < n_valid:
                    mem8[p + e] = uint32((word >> (8 * e)) & 0xFF)

    def kernel(tab, first, count, sbuf, codes32, mem32, mem16, mem8):
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        row, H, W = weight_of(tab, first, count, PREFIX, b)
        O, N, moff, bf16 = shard_of(tab, row)
        mvec = tab[row + F_MVEC] != 0
        e4m3 = tab[row + F_E4M3] != 0
        has_row = tab[row + F_HASROW] != 0
        rowdata = tab[row + F_ROWDATA]
        coldata = tab[row + F_COLDATA]
        rowbuf = tab[row + F_ROWBUF]
        colbuf = tab[row + F_COLBUF]
        kt = tab[row + F_NCB]
        wb = W // 32
        # chunks [0, F_NFC) of the shard are the fast-path kernel's, the rest the general one's
        base = (b - tab[row + PREFIX] + (0 if fast_path else tab[row + F_NFC])) * CAST_CHUNK
        hascol = with_col and tab[row + F_HASCOL] != 0
        # The fast-path kernel (compiled apart so that each path has its own register budget)
        # gets the full chunks of shards whose master loads and FP8 word stores are aligned
        # and whose groups of 4 never cross a row or a scale block (o % 4 == w % 4 == 0; Batch
        # picks them). Positions advance by a precomputed (rows, columns) step instead of a
        # division per group: the general path's per-element index arithmetic is what bounds
        # its speed.
        if fast_path:
            raw = cuda.local.array((GROUPS, 4), uint32)
            rscale = cuda.local.array(GROUPS, float32)
            cword = cuda.local.array(GROUPS, uint32)
            w32 = uint32(W)
            f = uint32(O + base + tid * 4)  # weights have < 2**31 elements (Batch checks)
            r = f // w32
            c = f - r * w32
            dr = uint32(STEP) // w32
            dc = uint32(STEP) - dr * w32
            for k in range(GROUPS):
                m = base + k * STEP + tid * 4
                load_group(raw, k, mem32, mem16, moff, m, bf16, True, True, True, True, True)
                if block2d:
                    rscale[k] = sbuf[rowbuf + (r >> 7) * kt + (c >> 7)]
                else:
                    if has_row:
                        rscale[k] = e8m0_multiplier(sbuf[rowbuf + r * wb + (c >> 5)])
                    if hascol:
                        cword[k] = codes32[(colbuf + (r >> 5) * W + c) >> 2]
                r += dr
                c += dc
                if c >= w32:
                    c -= w32
                    r += uint32(1)
            for k in range(GROUPS):
                m = base + k * STEP + tid * 4
                x0, x1, x2, x3 = decode4(raw, k, bf16)
                x0 = rnd(x0)
                x1 = rnd(x1)
                x2 = rnd(x2)
                x3 = rnd(x3)
                if has_row:
                    s = rscale[k]
                    mem32[(rowdata + O + m) >> 2] = pack(e4m3, x0 * s, x1 * s, x2 * s, x3 * s)
                if not block2d and hascol:
                    w = cword[k]
                    mem32[(coldata + O + m) >> 2] = pack(
                        e4m3, x0 * e8m0_multiplier(w & 0xFF),
                        x1 * e8m0_multiplier((w >> 8) & 0xFF),
                        x2 * e8m0_multiplier((w >> 16) & 0xFF),
                        x3 * e8m0_multiplier(w >> 24))
        else:
            raw = cuda.local.array((GROUPS, 4), uint32)
            for k in range(GROUPS):
                m = base + (k * THREADS + tid) * 4
                load_group(raw, k, mem32, mem16, moff, m, bf16, mvec and m + 3 < N, m < N,
                           m + 1 < N, m + 2 < N, m + 3 < N)
            sc = cuda.local.array(4, float32)
            cs = cuda.local.array(4, float32)
            rr = cuda.local.array(4, types.int64)
            cc = cuda.local.array(4, types.int64)
            for k in range(GROUPS):
                m = base + (k * THREADS + tid) * 4
                if m < N:
                    nv = min(N - m, 4)
                    f = O + m
                    r = types.int64(uint32(f) // uint32(W))
                    c = f - r * W
                    # positions of the 4 elements (a row may end inside the group)
                    for e in range(4):
                        ce = c + e
                        re = r
                        while ce >= W:
                            ce -= W
                            re += 1
                        rr[e] = re
                        cc[e] = ce
                    if block2d:
                        if c + 3 < W and (c % 128) <= 124:
                            s = sbuf[rowbuf + (r // 128) * kt + c // 128]
                            for e in range(4):
                                sc[e] = s
                        else:
                            for e in range(4):
                                sc[e] = sbuf[rowbuf + (rr[e] // 128) * kt + cc[e] // 128] \
                                    if e < nv else _ONE
                    else:
                        if has_row:
                            if c + 3 < W and (c % 32) <= 28:
                                s = e8m0_multiplier(sbuf[rowbuf + r * wb + c // 32])
                                for e in range(4):
                                    sc[e] = s
                            else:
                                for e in range(4):
                                    sc[e] = e8m0_multiplier(sbuf[rowbuf + rr[e] * wb + cc[e] // 32]) \
                                        if e < nv else _ONE
                        if with_col and tab[row + F_HASCOL] != 0:
                            if nv == 4 and c % 4 == 0:
                                word = codes32[(colbuf + (r // 32) * W + c) // 4]
                                for e in range(4):
                                    cs[e] = e8m0_multiplier((word >> (8 * e)) & 0xFF)
                            else:
                                for e in range(4):
                                    cs[e] = e8m0_multiplier(
                                        sbuf[colbuf + (rr[e] // 32) * W + cc[e]]) \
                                        if e < nv else _ONE
                    x0, x1, x2, x3 = decode4(raw, k, bf16)
                    x0 = rnd(x0)
                    x1 = rnd(x1)
                    x2 = rnd(x2)
                    x3 = rnd(x3)
                    if has_row or (with_col and block2d):
                        word = pack(e4m3, x0 * sc[0], x1 * sc[1], x2 * sc[2], x3 * sc[3])
                        if has_row:
                            store4(mem8, mem32, rowdata + f, word, nv)
                        if with_col and block2d:
                            for e in range(4):
                                if e < nv:
                                    mem8[coldata + cc[e] * H + rr[e]] = uint32(
                                        (word >> (8 * e)) & 0xFF)
                    if with_col and not block2d:
                        if tab[row + F_HASCOL] != 0:
                            word = pack(e4m3, x0 * cs[0], x1 * cs[1], x2 * cs[2], x3 * cs[3])
                            store4(mem8, mem32, coldata + f, word, nv)

    return kernel


def cast_argtypes(block2d):
    buf_t = types.float32 if block2d else types.uint8
    return (ptr(types.int64), types.int64, types.int64, ptr(buf_t), ptr(types.uint32),
            ptr(types.uint32), ptr(types.uint16), ptr(types.uint8))


def cast_pyfunc(block2d, model, with_col, fast_path=False):
    """The Python cast kernel: fast_path for the interior chunks of aligned shards, the other
    one for the rest."""
    return _cast_pyfunc(block2d, model, with_col, fast_path)


def build_cast(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.PartialCastSpec``."""
    bounds = CAST_THREADS if spec.min_blocks is None else (CAST_THREADS, spec.min_blocks)
    return (cast_pyfunc(spec.block2d, spec.model, spec.with_col, spec.fast_path),
            cast_argtypes(spec.block2d), bounds)
