"""RMSNorm in one pass per direction, the launcher of ``_rms_norm_kernel`` and the torch room's
door to it (``fp8blk.torch.norm``): Hugging Face's formula and its gradient for C-contiguous
(M, D) device arrays of one dtype, 16-byte aligned, D within the kernels' widths (:func:`serves`
says whether a call fits; docs/torch.md states the bytes and bounds).

    y, r = forward(x2d, weight, eps)            # y (M, D) in x's dtype, r (M,) float32
    dx, dw_part = backward(x2d, weight, dy2d, r)
    dw = dw_part.sum(0)                         # (D,) float32: the weight's gradient
"""
from __future__ import annotations

import numpy as np

from ..layout import cdiv
from . import _cache
from . import _specs as sp
from ._launch import adapter_of, cached_plan, kind_of, plan_cache, scalars

_F32 = np.dtype(np.float32)
_U32 = np.dtype(np.uint32)
_specs = plan_cache()   # (kind, D, backward) -> its RMSNormSpec, or False where not served
FORWARD_ITERS = 4                  # rows per row group per forward CTA
BACKWARD_ITERS = sp.RMS_ROW_ITERS  # per backward CTA: one partial row per group


def _build_spec(kind, width, backward):
    if width <= 0 or width % sp.ELEMS_PER_CHUNK[kind]:
        return False
    return sp.rms_norm_spec(kind, width, backward) or False


def _spec(kind, width, backward):
    return cached_plan(_specs, (kind, width, backward), _build_spec) or None


def serves(x2d, weight, dtype=None) -> bool:
    """Whether the kernels take x (M, D) and weight (D,): one dtype, C-contiguous, 16-byte
    aligned, D a whole number of 16-byte chunks (a multiple of 8, of 4 for float32) within the
    kernels' width (at most 256 threads x 8 chunks: 16384 elements of a 2-byte dtype). The
    bytes of y follow the formula but for the reduction order of ``sum(x * x)``."""
    ad = adapter_of(x2d)
    if x2d.ndim != 2 or weight.ndim != 1 or weight.shape[0] != x2d.shape[1] \
            or ad.dtype(x2d) != ad.dtype(weight) or not ad.contiguous(x2d) \
            or not ad.contiguous(weight) or ad.ptr(x2d) % 16 or ad.ptr(weight) % 16:
        return False
    try:
        kind = kind_of(ad.dtype(x2d), dtype)
    except TypeError:
        return False
    return _spec(kind, x2d.shape[1], False) is not None


def _geometry_of(ad, x2d, dtype, backward, iters):
    kind = kind_of(ad.dtype(x2d), dtype)
    m, d = x2d.shape
    spec = _spec(kind, d, backward)
    if spec is None:
        raise ValueError(f"rms_norm: rows of {d} elements are not served (see serves())")
    groups = spec.threads // spec.row_threads
    return spec, cdiv(m, groups * iters), groups


def _fp32_bits(v) -> int:
    return int(np.float32(v).view(np.uint32))


def forward(x2d, weight, eps: float, dtype=None):
    """(y, r): y (M, D) = ``weight * (x * r)`` (HF's formula, rounded as it rounds) in x's
    dtype, r (M,) float32 = ``rsqrt(mean(x * x) + eps)``, on x's device and stream.
    ``dtype``: the logical dtype of a CuPy array holding bf16 as uint16.

    >>> y, r = forward(x2d, weight, 1e-6)                  # doctest: +SKIP
    """
    ad = adapter_of(x2d)
    m, d = x2d.shape
    spec, grid, _ = _geometry_of(ad, x2d, dtype, False, FORWARD_ITERS)
    y = ad.empty((m, d), ad.dtype(x2d), x2d)
    r = ad.empty((m,), _F32, x2d)
    if m:
        args = ad.args((x2d, weight, y, r), (_U32, _U32, _U32, _F32), scalars(
            m, d, FORWARD_ITERS, _fp32_bits(np.float32(1) / np.float32(d)), _fp32_bits(eps)))
        kernel = _cache.kernel("rms_norm", spec, ad.device_index(x2d))
        ad.launch(kernel, (grid, 1, 1), (spec.threads, 1, 1), args, x2d)
    return y, r


def backward(x2d, weight, dy2d, r, dtype=None):
    """(dx, dw_part): dx (M, D) in x's dtype, the gradient of HF's formula with respect to x
    given dy (M, D) and the forward pass's r (M,) float32; dw_part (P, D) float32, whose sum
    over rows is the weight's gradient (P depends on M and D only).

    >>> dx, dw_part = backward(x2d, weight, dy2d, r)       # doctest: +SKIP
    >>> dw = dw_part.sum(0)                                # doctest: +SKIP
    """
    ad = adapter_of(x2d)
    m, d = x2d.shape
    if tuple(dy2d.shape) != (m, d) or ad.dtype(dy2d) != ad.dtype(x2d) \
            or not ad.contiguous(dy2d) or ad.ptr(dy2d) % 16:
        raise ValueError(f"rms_norm.backward: dy must be C-contiguous, 16-byte aligned "
                         f"{ad.dtype(x2d)} of shape {(m, d)}, got {ad.dtype(dy2d)} "
                         f"{tuple(dy2d.shape)}")
    if tuple(r.shape) != (m,) or ad.dtype(r) != _F32 or not ad.contiguous(r):
        raise ValueError(f"rms_norm.backward: r must be C-contiguous float32 of shape ({m},)")
    spec, grid, groups = _geometry_of(ad, x2d, dtype, True, BACKWARD_ITERS)
    dx = ad.empty((m, d), ad.dtype(x2d), x2d)
    dw_part = ad.empty((grid * groups, d), _F32, x2d)
    if m:
        args = ad.args((x2d, weight, dy2d, r, dx, dw_part), (_U32,) * 3 + (_F32,) + (_U32,) * 2,
                       scalars(m, d, BACKWARD_ITERS,
                               _fp32_bits(np.float32(1) / np.float32(d))))
        kernel = _cache.kernel("rms_norm", spec, ad.device_index(x2d))
        ad.launch(kernel, (grid, 1, 1), (spec.threads, 1, 1), args, x2d)
    return dx, dw_part


__all__ = ["forward", "backward", "serves"]
