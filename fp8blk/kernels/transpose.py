"""Block2D FP8 transpose (``BlockTensor.create_columnwise``): (R, C) bytes -> (C, R) bytes and
the tile scales (cdiv(R,128), >= cdiv(C,128)) -> (cdiv(C,128), round4(cdiv(R,128))), padding
1.0, in one kernel. The same call turns columnwise buffers back into rowwise ones.

Kernel: a CTA of 256 threads owns a 128 x 128 byte tile. Thread (quad q = t // 8, chunk
c = t % 8) loads 16 bytes from each of rows 4q..4q+3 (four 16-byte loads in flight),
transposes the 4 x 16 bytes in registers with ``prmt`` into 16 words (one per column, 4 rows
each), writes them to a shared tile of words [128 cols][32 + 1], and after one barrier each
thread stores 4 x 16 bytes of output rows (rows that are not 16-byte aligned, R % 16 != 0:
``_device.tile_row_storer``). Addresses are byte offsets (no 64-bit division). CTA (0, 0)
also transposes the (tiny) scale tensor's entry for its tile; every CTA writes its own tile's
scale, and all CTAs share the padding fill.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import _device as dev
from ._device_arrays import adapter_of
from ._host import cdiv, i64, round_up
from ._numba import compile_kernel, cuda, ptr, st_v4_at, types

THREADS = 256
T = 128  # tile edge (bytes)


def make_kernel_pyfunc(vec_in, vec_out):
    """vec_in: C % 16 == 0 (16-byte loads); vec_out: R % 16 == 0 (16-byte stores)."""
    uint32 = types.uint32
    ONE = np.float32(1.0)
    fill_padding = dev.fill_padding
    store_unaligned = dev.tile_row_storer(T, T, THREADS)
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
        if vec_out:
            for it in range(T * T // 16 // THREADS):
                u = tid + THREADS * it
                kk = u // 8
                part = u % 8
                k = c0 + kk
                mm = r0 + part * 16
                if k < C and mm < R:
                    st_v4_at(dst, k * R + mm, tb[kk, part * 4], tb[kk, part * 4 + 1],
                             tb[kk, part * 4 + 2], tb[kk, part * 4 + 3])
        else:
            # output rows not 16-byte aligned: aligned 16-byte chunks, the partial chunks at
            # the row ends with 1/2/4/8-byte stores
            store_unaligned(tb, dst, c0, r0, C, R, tid)

    return kernel


def argtypes(vec_in, vec_out):
    return (ptr(types.uint32 if vec_in else types.uint8),
            ptr(types.uint32 if vec_out else types.uint8),
            ptr(types.float32), ptr(types.float32), types.int64, types.int64, types.int64)


@lru_cache(maxsize=None)
def get_kernel(vec_in, vec_out):
    return compile_kernel(make_kernel_pyfunc(vec_in, vec_out), argtypes(vec_in, vec_out),
                          launch_bounds=THREADS)


def _check_out(ad, buf, shape, dtype, what):
    if buf is None:
        return
    if tuple(buf.shape) != shape or ad.dtype(buf) != dtype or not ad.contiguous(buf):
        raise ValueError(f"out {what} must be a C-contiguous {np.dtype(dtype).name} array of "
                         f"shape {shape}, got {buf.dtype} {tuple(buf.shape)}")


def block2d_columnwise_from_rowwise(rowwise_data, rowwise_scale_inv, out=(None, None)):
    """Block2D columnwise buffers from rowwise ones (same contract as the reference): returns
    (data (C, R) uint8, scale_inv fp32 (cdiv(C,128), round4(cdiv(R,128)))), writing into the
    buffers given in ``out`` (no allocation when both are given)."""
    ad = adapter_of(rowwise_data)
    rows, cols = rowwise_data.shape
    nrt, nct = cdiv(rows, T), cdiv(cols, T)
    sinv_in = rowwise_scale_inv
    if sinv_in.ndim != 2 or sinv_in.shape[0] < nrt or sinv_in.shape[1] < nct \
            or ad.dtype(sinv_in) != np.float32 or not ad.contiguous(sinv_in):
        raise ValueError(f"rowwise scale_inv must be C-contiguous float32 of shape at least "
                         f"({nrt}, {nct}), got {sinv_in.dtype} {tuple(sinv_in.shape)}")
    out_data, out_sinv = out
    _check_out(ad, out_data, (cols, rows), np.uint8, "data")
    _check_out(ad, out_sinv, (nct, round_up(nrt, 4)), np.float32, "scale_inv")
    if out_data is None:
        out_data = ad.empty((cols, rows), np.dtype(np.uint8), rowwise_data)
    if out_sinv is None:
        out_sinv = ad.empty((nct, round_up(nrt, 4)), np.dtype(np.float32), rowwise_data)
    if rows == 0 or cols == 0:
        if out_sinv.shape[0] * out_sinv.shape[1]:
            out_sinv[...] = 1.0
        return out_data, out_sinv
    vec_in = cols % 16 == 0 and ad.ptr(rowwise_data) % 16 == 0
    vec_out = rows % 16 == 0 and ad.ptr(out_data) % 16 == 0
    kernel = get_kernel(vec_in, vec_out)
    args = (ad.arg(rowwise_data, np.uint32 if vec_in else np.uint8),
            ad.arg(out_data, np.uint32 if vec_out else np.uint8),
            ad.arg(sinv_in, np.float32), ad.arg(out_sinv, np.float32),
            i64(rows), i64(cols), i64(sinv_in.shape[1]))
    ad.launch(kernel, (nrt, nct, 1), (THREADS, 1, 1), args, rowwise_data)
    return out_data, out_sinv
