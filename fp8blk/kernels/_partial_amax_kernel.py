"""Builder of the partial-amax kernels of the master-weight path (launcher and batch table:
``partial``).

Kernels
-------
* Block2D: one CUDA block (256 threads) per 128x128 tile the shard touches; a warp reads one
  128-element row segment per step (16-byte loads when the shard is aligned), every thread
  keeps a running ``fmaxf`` from 0 over the model-dtype-rounded values, then warp shuffles and a
  shared-memory step give the tile amax, written to the packed fp32 buffer.
* MXFP8: one CUDA block (128 threads) per 32-row band x 512 columns; a lane owns 4 columns,
  so the column (32x1) amaxes stay in registers over the band's rows and each row (1x32) amax
  takes 2 in-thread maxes and 3 xor shuffles over the 8 lanes of a block. E8M0 codes are made
  in the kernel and written as bytes into the packed uint8 buffer (the collective's payload).
  Row-only weights use a kernel compiled without the columnwise part.

Untouched blocks are left as the caller zeroed them (amax 0, code 0): the identity of MAX.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _kernel_lib as dev
from ._kernel_lib import e8m0_code
from ._numba import (bf16x2_f32, bits_f32, cuda, device, f16x2_f32,
                     f32_bf16_bits, f32_f16_bits, fmax32, group_fmax, ld_v4, ptr,
                     shfl_xor_f32, types)
from ._specs import (AMAX2D_THREADS, F_AMAX0, F_AMAXF0, F_BAND0, F_COLBUF, F_E4M3,
                           F_FASTROW0, F_FASTROW1, F_H, F_HASCOL, F_HASROW, F_MBF16, F_MOFF,
                           F_N, F_NCB, F_O, F_ROWBUF, F_VEC2D, F_W, MX_COLS,
                           MXAMAX_THREADS, NF)

# ---- device helpers -----------------------------------------------------------------------------


@device
def band_row(tab, row, local, ncb, fast_path):
    """The band row (tile row for Block2D) of a weight's `local`-th CUDA block in its
    fast-path or general launch: fast rows are [F_FASTROW0, F_FASTROW1); the general launch
    covers the touched rows before them, then those after them."""
    r = local // ncb
    if fast_path:
        return tab[row + F_FASTROW0] + r
    head = tab[row + F_FASTROW0] - tab[row + F_BAND0]
    if r < head:
        return tab[row + F_BAND0] + r
    return tab[row + F_FASTROW1] + (r - head)


@device
def find_weight(tab, first, count, field, b):
    """Last table row in [first, first+count) whose `field` (a prefix of work units) <= b."""
    lo = first
    hi = first + count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tab[mid * NF + field] <= b:
            lo = mid
        else:
            hi = mid - 1
    return lo


@device
def weight_of(tab, first, count, prefix, b):
    """(row offset in the flat table, h, w) of the weight owning work unit b of a launch over
    rows [first, first + count) whose per-row first unit is field `prefix`."""
    row = find_weight(tab, first, count, prefix, b) * NF
    return row, tab[row + F_H], tab[row + F_W]


@device
def shard_of(tab, row):
    """(o, n, master offset, master is bf16) of the weight at table offset `row`."""
    return tab[row + F_O], tab[row + F_N], tab[row + F_MOFF], tab[row + F_MBF16] != 0


@lru_cache(maxsize=None)
def model_rounder(model):
    """``rnd(v)``: float32 v rounded once to the model dtype (dev.F32 / BF16 / F16), as float32."""
    if model == dev.F32:
        @device
        def rnd(v):
            return v
    elif model == dev.BF16:
        @device
        def rnd(v):
            return bits_f32(types.uint32(f32_bf16_bits(v)) << 16)
    else:
        @device
        def rnd(v):
            lo, hi = f16x2_f32(types.uint32(f32_f16_bits(v)))
            return lo
    return rnd


@device
def load_group(raw, k, mem32, mem16, moff, m, bf16, vec, v0, v1, v2, v3):
    """Raw words of master elements m..m+3 into raw[k, :]: fp32 bits in raw[k, e], or bf16
    pairs in raw[k, 0..1] (element 2i in the low half of word i). ``vec``: all four are valid
    and aligned (one 16-byte or two 4-byte loads); otherwise v0..v3 say which elements are
    valid, and invalid ones read as +0."""
    if vec:
        if bf16:
            j = (moff + m) >> 1
            raw[k, 0] = mem32[j]
            raw[k, 1] = mem32[j + 1]
        else:
            w0, w1, w2, w3 = ld_v4(mem32, moff + m)
            raw[k, 0] = w0
            raw[k, 1] = w1
            raw[k, 2] = w2
            raw[k, 3] = w3
    elif bf16:
        lo = types.uint32(0)
        hi = types.uint32(0)
        if v0:
            lo = types.uint32(mem16[moff + m])
        if v1:
            lo = lo | (types.uint32(mem16[moff + m + 1]) << 16)
        if v2:
            hi = types.uint32(mem16[moff + m + 2])
        if v3:
            hi = hi | (types.uint32(mem16[moff + m + 3]) << 16)
        raw[k, 0] = lo
        raw[k, 1] = hi
    else:
        raw[k, 0] = mem32[moff + m] if v0 else types.uint32(0)
        raw[k, 1] = mem32[moff + m + 1] if v1 else types.uint32(0)
        raw[k, 2] = mem32[moff + m + 2] if v2 else types.uint32(0)
        raw[k, 3] = mem32[moff + m + 3] if v3 else types.uint32(0)


@device
def load_rows_aligned(raw, rows, valid, mem32, mem16, moff, m_first, row_step, bf16):
    """raw[k, :] = the 4 master elements at m_first + k * row_step (k < rows) of an aligned
    shard (see load_group), or zeros where this lane's columns are outside the weight."""
    if valid:
        for k in range(rows):
            load_group(raw, k, mem32, mem16, moff, m_first + k * row_step, bf16, True, True,
                       True, True, True)
    else:
        for k in range(rows):
            for e in range(4):
                raw[k, e] = types.uint32(0)


@device
def decode4(raw, k, bf16):
    """The four float32 values of raw[k, :] (see load_group)."""
    if bf16:
        a, b = bf16x2_f32(raw[k, 0])
        c, d = bf16x2_f32(raw[k, 1])
        return a, b, c, d
    return bits_f32(raw[k, 0]), bits_f32(raw[k, 1]), bits_f32(raw[k, 2]), bits_f32(raw[k, 3])


@device
def scatter_max(v, n, m, lane, red, tid):
    """One reduce-scatter step over lanes l and l ^ m of the 2n values v[0:2n]: afterwards
    v[j] (j < n) is the max of both lanes' v[j + n] if this lane has bit m set, else of
    their v[j]. Three steps (m = 4, 2, 1) leave lane l of an 8-lane group with entries
    2 * (l % 8) and 2 * (l % 8) + 1 of the group's 16, reduced over the group."""
    upper = (lane & m) != 0
    for j in range(n):
        send = v[j] if upper else v[j + n]
        keep = v[j + n] if upper else v[j]
        v[j] = fmax32(keep, shfl_xor_f32(send, m, red, tid))


# ---- kernels ------------------------------------------------------------------------------------


def _block2d_amax_pyfunc(model, fast_path):
    rnd = model_rounder(model)
    PREFIX = F_AMAXF0 if fast_path else F_AMAX0
    THREADS = AMAX2D_THREADS
    WARPS = THREADS // 32
    STEPS = 128 // WARPS  # rows per warp
    ZERO = np.float32(0.0)
    uint32, float32 = types.uint32, types.float32

    def kernel(tab, first, count, amax_out, codes32, mem32, mem16):  # codes32: unused
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        red = cuda.shared.array(THREADS, float32)
        wred = cuda.shared.array(WARPS, float32)
        row, H, W = weight_of(tab, first, count, PREFIX, b)
        O, N, moff, bf16 = shard_of(tab, row)
        vec = tab[row + F_VEC2D] != 0
        ncb = tab[row + F_NCB]
        local = b - tab[row + PREFIX]
        tr = band_row(tab, row, local, ncb, fast_path)
        tc = local % ncb
        c = tc * 128 + lane * 4
        raw = cuda.local.array((STEPS, 4), uint32)
        m0 = (tr * 128 + warp) * W + c - O
        step = WARPS * W
        # Tile rows inside the weight and an aligned shard (Batch picks them) go to the kernel
        # compiled with fast_path: no per-element bounds, since index arithmetic, not DRAM,
        # bounds the general path; compiled apart so that each has its own register budget.
        if fast_path:
            # W % 4 == 0 here: a lane's 4 columns are all in or all out
            load_rows_aligned(raw, STEPS, c < W, mem32, mem16, moff, m0, step, bf16)
        else:
            for k in range(STEPS):
                r = tr * 128 + warp + WARPS * k
                m = m0 + k * step
                ok = r < H
                v0 = ok and c < W and m >= 0 and m < N
                v1 = ok and c + 1 < W and m + 1 >= 0 and m + 1 < N
                v2 = ok and c + 2 < W and m + 2 >= 0 and m + 2 < N
                v3 = ok and c + 3 < W and m + 3 >= 0 and m + 3 < N
                load_group(raw, k, mem32, mem16, moff, m, bf16, vec and v0 and v3, v0, v1, v2,
                           v3)
        t = ZERO
        for k in range(STEPS):
            a, bb, cc, d = decode4(raw, k, bf16)
            t = fmax32(t, abs(a))
            t = fmax32(t, abs(bb))
            t = fmax32(t, abs(cc))
            t = fmax32(t, abs(d))
        # Rounding to the model dtype is monotonic and odd, so the max of the rounded |x|
        # equals the rounded max of |x|: one rounding per thread instead of one per element.
        t = rnd(t)
        t = group_fmax(t, 1, 16, red, tid)
        if lane == 0:
            wred[warp] = t
        cuda.syncthreads()
        if tid == 0:
            for w in range(1, WARPS):
                t = fmax32(t, wred[w])
            amax_out[tab[row + F_ROWBUF] + tr * ncb + tc] = t

    return kernel


def _mxfp8_amax_pyfunc(model, with_col, fast_path):
    rnd = model_rounder(model)
    PREFIX = F_AMAXF0 if fast_path else F_AMAX0
    THREADS = MXAMAX_THREADS
    HALF = 16  # rows loaded before use (two halves of the 32-row band)
    ZERO = np.float32(0.0)
    INV_E4M3, INV_E5M2 = np.float32(1) / np.float32(448.0), np.float32(1) / np.float32(57344.0)
    uint32, float32 = types.uint32, types.float32

    def kernel(tab, first, count, codes, codes32, mem32, mem16):
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        red = cuda.shared.array(THREADS, float32)
        row, _, W = weight_of(tab, first, count, PREFIX, b)
        O, N, moff, bf16 = shard_of(tab, row)
        vec = tab[row + F_VEC2D] != 0
        has_row = tab[row + F_HASROW] != 0
        inv_f = INV_E4M3 if tab[row + F_E4M3] != 0 else INV_E5M2
        ncb = tab[row + F_NCB]
        local = b - tab[row + PREFIX]
        band = band_row(tab, row, local, ncb, fast_path)
        c0 = (local % ncb) * MX_COLS
        c = c0 + warp * 128 + lane * 4
        rowbuf = tab[row + F_ROWBUF]
        wb = W // 32
        m0 = band * 32 * W + c - O
        # bands inside an aligned shard: the fast_path kernel (see Block2D)
        cm0 = ZERO
        cm1 = ZERO
        cm2 = ZERO
        cm3 = ZERO
        raw = cuda.local.array((HALF, 4), uint32)
        rm = cuda.local.array(HALF, float32)  # per row: max |x| of this lane's 4 columns
        for half in range(2):
            if fast_path:
                # W % 4 == 0 here: a lane's 4 columns are all in or all out
                load_rows_aligned(raw, HALF, c < W, mem32, mem16, moff, m0 + half * HALF * W,
                                  W, bf16)
            else:
                for k in range(HALF):
                    m = m0 + (half * HALF + k) * W
                    v0 = c < W and m >= 0 and m < N
                    v3 = c < W and m + 3 >= 0 and m + 3 < N
                    load_group(raw, k, mem32, mem16, moff, m, bf16, vec and v0 and v3, v0,
                               c < W and m + 1 >= 0 and m + 1 < N,
                               c < W and m + 2 >= 0 and m + 2 < N, v3)
            for k in range(HALF):
                a0, a1, a2, a3 = decode4(raw, k, bf16)
                a0 = abs(a0)
                a1 = abs(a1)
                a2 = abs(a2)
                a3 = abs(a3)
                if with_col:
                    cm0 = fmax32(cm0, a0)
                    cm1 = fmax32(cm1, a1)
                    cm2 = fmax32(cm2, a2)
                    cm3 = fmax32(cm3, a3)
                rm[k] = fmax32(fmax32(fmax32(fmax32(ZERO, a0), a1), a2), a3)
            if has_row:
                # The 1x32 amaxes of the HALF rows: a reduce-scatter over the 8 lanes of a
                # block (xor 4, 2, 1) leaves lane l with rows 2*(l%8) and 2*(l%8)+1, fully
                # reduced: 14 shuffles and 2 E8M0 codes per lane instead of 48 shuffles and 16
                # dependent code computations.
                scatter_max(rm, 8, 4, lane, red, tid)
                scatter_max(rm, 4, 2, lane, red, tid)
                scatter_max(rm, 2, 1, lane, red, tid)
                if c - (lane % 8) * 4 < W:
                    rsel = 2 * (lane % 8)
                    blk = rowbuf + (band * 32 + half * HALF) * wb + c // 32
                    for j in range(2):
                        # rounding commutes with max (monotonic, odd): round the block amax
                        codes[blk + (rsel + j) * wb] = e8m0_code(rnd(rm[j]), inv_f)
        if with_col:
            if tab[row + F_HASCOL] != 0 and c < W:
                word = (uint32(e8m0_code(rnd(cm0), inv_f))
                        | (uint32(e8m0_code(rnd(cm1), inv_f)) << 8)
                        | (uint32(e8m0_code(rnd(cm2), inv_f)) << 16)
                        | (uint32(e8m0_code(rnd(cm3), inv_f)) << 24))
                codes32[(tab[row + F_COLBUF] + band * W + c) // 4] = word

    return kernel


def amax_argtypes(block2d):
    buf_t = types.float32 if block2d else types.uint8
    return (ptr(types.int64), types.int64, types.int64, ptr(buf_t), ptr(types.uint32),
            ptr(types.uint32), ptr(types.uint16))


def amax_pyfunc(block2d, model, with_col, fast_path=False):
    """The Python kernel (for compile_ptx tests and :func:`build`): the fast_path
    one handles the interior tiles / bands of aligned shards, the other one the rest."""
    if block2d:
        return _block2d_amax_pyfunc(model, fast_path)
    return _mxfp8_amax_pyfunc(model, with_col, fast_path)


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.PartialAmaxSpec``."""
    threads = AMAX2D_THREADS if spec.block2d else MXAMAX_THREADS
    bounds = threads if spec.min_blocks is None else (threads, spec.min_blocks)
    return (amax_pyfunc(spec.block2d, spec.model, spec.with_col, spec.fast_path),
            amax_argtypes(spec.block2d), bounds)
