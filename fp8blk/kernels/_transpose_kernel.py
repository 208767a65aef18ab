"""Builder of the Block2D FP8 transpose kernel (launcher: ``transpose``).

Kernel: a CTA of 256 threads owns a 128 x 128 byte tile. Thread (quad q = t // 8, chunk
c = t % 8) loads 16 bytes from each of rows 4q..4q+3 (four 16-byte loads in flight),
transposes the 4 x 16 bytes in registers with ``prmt`` into 16 words (one per column, 4 rows
each), writes them to a shared tile of words [128 cols][32 + 1], and after one barrier each
thread stores 4 x 16 bytes of output rows (rows that are not 16-byte aligned, R % 16 != 0:
``_kernel_lib.tile_row_storer``). Addresses are byte offsets (no 64-bit division). CTA (0, 0)
also transposes the (tiny) scale tensor's entry for its tile; every CTA writes its own tile's
scale, and all CTAs share the padding fill.

Arguments: src, dst, src scale_inv, dst scale_inv (raw pointers), R, C, src scale_inv row
length. Grid: (cdiv(R, 128), cdiv(C, 128)).
"""
from __future__ import annotations

import numpy as np

from . import _kernel_lib as dev
from ._numba import cuda, ptr, types
from ._specs import TR_THREADS as THREADS
from ._specs import TR_TILE as T


def make_kernel_pyfunc(vec_in, vec_out):
    """vec_in: C % 16 == 0 (16-byte loads); vec_out: R % 16 == 0 (16-byte stores)."""
    uint32 = types.uint32
    ONE = np.float32(1.0)
    fill_padding = dev.fill_padding
    store_tile = dev.tile_storer(T, T, THREADS, vec_out)
    ld_v4_at_or = dev.ld_v4_at_or
    transpose_bytes_4x4 = dev.transpose_bytes_4x4
    TB_SHAPE = (T, T // 4 + 1)  # +1 word per row: conflict-free 16-byte reads

    def kernel(src, dst, ssinv, dsinv, R, C, ld_ssinv):
        tid = cuda.threadIdx.x
        bm = cuda.blockIdx.x
        bk = cuda.blockIdx.y
        r0 = bm * T
        c0 = bk * T
        q = tid // 8
        c = tid % 8
        tb = cuda.shared.array(TB_SHAPE, uint32)
        nrt = (R + T - 1) // T
        nct = (C + T - 1) // T
        gtid = (bk * cuda.gridDim.x + bm) * THREADS + tid
        fill_padding(dsinv, nct, nrt, nct, (nrt + 3) // 4 * 4, ONE, gtid,
                     cuda.gridDim.x * cuda.gridDim.y * THREADS)
        if tid == 0:
            dsinv[bk * ((nrt + 3) // 4 * 4) + bm] = ssinv[bm * ld_ssinv + bk]
        rows = cuda.local.array((4, 4), uint32)
        col = c0 + 16 * c
        for i in range(4):
            r = r0 + 4 * q + i
            if vec_in:
                w0, w1, w2, w3 = ld_v4_at_or(src, r * C + col, r < R and col < C, uint32(0))
                rows[i, 0] = w0
                rows[i, 1] = w1
                rows[i, 2] = w2
                rows[i, 3] = w3
            else:
                for w in range(4):
                    word = uint32(0)
                    for b in range(4):
                        if r < R and col + 4 * w + b < C:
                            word |= uint32(src[r * C + col + 4 * w + b]) << (8 * b)
                    rows[i, w] = word
        for w in range(4):
            t0, t1, t2, t3 = transpose_bytes_4x4(rows[0, w], rows[1, w], rows[2, w], rows[3, w])
            tb[16 * c + 4 * w, q] = t0
            tb[16 * c + 4 * w + 1, q] = t1
            tb[16 * c + 4 * w + 2, q] = t2
            tb[16 * c + 4 * w + 3, q] = t3
        cuda.syncthreads()
        # output rows not 16-byte aligned (not vec_out): aligned 16-byte chunks, the partial
        # chunks at the row ends with 1/2/4/8-byte stores
        store_tile(tb, dst, c0, r0, C, R, tid)

    return kernel


def argtypes(vec_in, vec_out):
    return (ptr(types.uint32 if vec_in else types.uint8),
            ptr(types.uint32 if vec_out else types.uint8),
            ptr(types.float32), ptr(types.float32), types.int64, types.int64, types.int64)


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.TransposeSpec``."""
    return (make_kernel_pyfunc(spec.vec_in, spec.vec_out), argtypes(spec.vec_in, spec.vec_out),
            THREADS)
