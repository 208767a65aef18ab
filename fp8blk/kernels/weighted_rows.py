"""The experts' padded rows from token rows scaled by their routed pairs' weights, in one pass:
the launcher of ``_weighted_rows_kernel`` and the torch room's door to it (the experts'
combine, backward: ``fp8blk.torch.moe.grouped``), for bf16 device arrays.

    out = weighted_rows(src, w, pairs, top_k)

src (T, H) bf16, C-contiguous, H a multiple of 8, 16-byte aligned; w (T * top_k,) float32 (pair
``t * top_k + j``'s weight); pairs (R,) int64: the pair each of the R rows holds, T * top_k
(or more) for a padding row. out (R, H) in src's dtype: ``out[r] = src[pairs[r] // top_k] *
w[pairs[r]]`` rounded once, -0 written as +0, zeros for a padding row (the kernel's module
states the bytes). :func:`serves` says whether a call fits.
"""
from __future__ import annotations

import numpy as np

from ..layout import cdiv
from . import _cache
from . import _specs as sp
from ._launch import adapter_of, kind_among, scalars

# bf16 only: fp16 rows differed from torch's bytes on the H200 (not yet explained), so fp16
# keeps torch's ops
_SPECS = {sp.BF16: sp.WeightedRowsSpec(kind=sp.BF16)}
_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)


def _kind(ad, x, dtype):
    return kind_among(ad, x, dtype, _SPECS)


def serves(src, w, pairs, dtype=None) -> bool:
    """Whether the kernel takes these arrays (module docstring): one device, src bf16
    (``dtype``: the logical dtype of a CuPy array holding bf16 as uint16), 2-D C-contiguous,
    16-byte aligned, its width a multiple of 8; w float32 and pairs int64, 1-D contiguous."""
    try:
        ad = adapter_of(src)
    except TypeError:
        return False
    if _kind(ad, src, dtype) is None or src.ndim != 2 or src.shape[1] % 8 \
            or not ad.contiguous(src) or ad.ptr(src) % 16:
        return False
    device = ad.device_index(src)
    return all(adapter_of(a) is ad and ad.device_index(a) == device and a.ndim == 1
               and ad.contiguous(a) and ad.dtype(a) == t for a, t in ((w, _F32), (pairs, _I64)))


def weighted_rows(src, w, pairs, top_k: int, dtype=None):
    """(R, H) in src's dtype, on src's device and stream (module docstring).

    >>> dy = weighted_rows(dout, w.reshape(-1), routing.pairs(), routing.top_k)  # doctest: +SKIP
    """
    if not serves(src, w, pairs, dtype):
        raise ValueError("weighted_rows: src must be a C-contiguous, 16-byte aligned (T, H) "
                         "bf16 array with H a multiple of 8, w a float32 vector and "
                         "pairs an int64 vector, all on one device")
    ad = adapter_of(src)
    rows, width = pairs.shape[0], src.shape[1]
    out = ad.empty((rows, width), ad.dtype(src), src)
    chunks = rows * (width // 8)
    if chunks:
        args = ad.args((src, w, pairs, out), (np.dtype(np.uint32), _F32, _I64,
                                              np.dtype(np.uint32)),
                       scalars(rows, width // 8, top_k, w.shape[0]))
        kernel = _cache.kernel("weighted_rows", _SPECS[_kind(ad, src, dtype)],
                               ad.device_index(src))
        grid = cdiv(chunks, sp.ROWS_THREADS * sp.ROWS_ITERS)
        ad.launch(kernel, (grid, 1, 1), (sp.ROWS_THREADS, 1, 1), args, src)
    return out


__all__ = ["weighted_rows", "serves"]
