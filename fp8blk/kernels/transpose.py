"""Block2D FP8 transpose (``BlockTensor.create_columnwise``): (R, C) bytes -> (C, R) bytes and
the tile scales (cdiv(R,128), >= cdiv(C,128)) -> (cdiv(C,128), round4(cdiv(R,128))), padding
1.0, in one kernel (``_transpose_kernel``, loaded through ``_compiled``). The same call turns columnwise buffers back into
rowwise ones.
"""
from __future__ import annotations

import numpy as np

from . import _compiled
from ._host import cdiv, data_ptr, i64, module_of, pointer_arg, round_up
from ._specs import TR_THREADS as THREADS
from ._specs import TR_TILE as T
from ._specs import TransposeSpec


_kernels = {}  # (vec_in, vec_out) -> kernel


def _kernel_for(vec_in, vec_out):
    k = _kernels.get((vec_in, vec_out))
    if k is None:
        k = _kernels[(vec_in, vec_out)] = _compiled.kernel("transpose",
                                                           TransposeSpec(vec_in, vec_out))
    return k


def _check_out(buf, shape, dtype, what):
    if buf is None:
        return
    if tuple(buf.shape) != shape or buf.dtype != dtype or not buf.flags.c_contiguous:
        raise ValueError(f"out {what} must be a C-contiguous {np.dtype(dtype).name} array of "
                         f"shape {shape}, got {buf.dtype} {tuple(buf.shape)}")


def block2d_columnwise_from_rowwise(rowwise_data, rowwise_scale_inv, out=(None, None)):
    """Block2D columnwise buffers from rowwise ones (same contract as the reference): returns
    (data (C, R) uint8, scale_inv fp32 (cdiv(C,128), round4(cdiv(R,128)))), writing into the
    buffers given in ``out`` (no allocation when both are given)."""
    xp = module_of(rowwise_data)
    rows, cols = rowwise_data.shape
    nrt, nct = cdiv(rows, T), cdiv(cols, T)
    sinv_in = rowwise_scale_inv
    if sinv_in.ndim != 2 or sinv_in.shape[0] < nrt or sinv_in.shape[1] < nct \
            or sinv_in.dtype != np.float32 or not sinv_in.flags.c_contiguous:
        raise ValueError(f"rowwise scale_inv must be C-contiguous float32 of shape at least "
                         f"({nrt}, {nct}), got {sinv_in.dtype} {tuple(sinv_in.shape)}")
    out_data, out_sinv = out
    _check_out(out_data, (cols, rows), np.uint8, "data")
    _check_out(out_sinv, (nct, round_up(nrt, 4)), np.float32, "scale_inv")
    if out_data is None:
        out_data = xp.empty((cols, rows), dtype=np.uint8)
    if out_sinv is None:
        out_sinv = xp.empty((nct, round_up(nrt, 4)), dtype=np.float32)
    if rows == 0 or cols == 0:
        if out_sinv.size:
            out_sinv[...] = 1.0
        return out_data, out_sinv
    vec_in = cols % 16 == 0 and data_ptr(rowwise_data) % 16 == 0
    vec_out = rows % 16 == 0 and data_ptr(out_data) % 16 == 0
    kernel = _kernel_for(vec_in, vec_out)
    args = (pointer_arg(rowwise_data, np.uint32 if vec_in else np.uint8),
            pointer_arg(out_data, np.uint32 if vec_out else np.uint8),
            pointer_arg(sinv_in, np.float32), pointer_arg(out_sinv, np.float32),
            i64(rows), i64(cols), i64(sinv_in.shape[1]))
    kernel((nrt, nct, 1), (THREADS, 1, 1), args)
    return out_data, out_sinv
