"""Block2D FP8 transpose (``BlockTensor.create_columnwise``), the launcher of
``_transpose_kernel``: (R, C) bytes -> (C, R) bytes and the tile scales (cdiv(R,128),
>= cdiv(C,128)) -> (cdiv(C,128), round4(cdiv(R,128))), padding 1.0, in one kernel. The same
call turns columnwise buffers back into rowwise ones.
"""
from __future__ import annotations

import numpy as np

from ..layout import cdiv, round_up
from . import _cache
from ._launch import adapter_of, scalars
from ._specs import TR_THREADS as THREADS
from ._specs import TR_TILE as T
from ._specs import TransposeSpec


_kernels = {}  # (vec_in, vec_out, device) -> kernel


def _kernel_for(vec_in, vec_out, device):
    k = _kernels.get((vec_in, vec_out, device))
    if k is None:
        k = _kernels[(vec_in, vec_out, device)] = _cache.kernel(
            "transpose", TransposeSpec(vec_in, vec_out), device)
    return k


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
    kernel = _kernel_for(vec_in, vec_out, ad.device_index(rowwise_data))
    args = ad.args((rowwise_data, out_data, sinv_in, out_sinv),
                   (np.uint32 if vec_in else np.uint8, np.uint32 if vec_out else np.uint8,
                    np.float32, np.float32), scalars(rows, cols, sinv_in.shape[1]))
    ad.launch(kernel, (nrt, nct, 1), (THREADS, 1, 1), args, rowwise_data)
    return out_data, out_sinv
