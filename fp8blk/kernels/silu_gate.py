"""The SiLU gate ``silu(g) * u`` in one pass per direction, the launcher of
``_silu_gate_kernel`` and the torch room's door to it (``fp8blk.torch.mlp``, the experts'
gating in ``fp8blk.torch.moe``): the bytes of torch's CUDA kernels for ``F.silu(g) * u`` and
of autograd's backward of it, for bf16 or fp16 (M, I) device arrays whose rows are contiguous
and whose row strides may differ (g and u may be the two halves of one (M, 2I) buffer).
:func:`serves` says whether a call fits: I a multiple of 8, addresses and row strides
multiples of 16 bytes.

    p = forward(g, u)                 # (M, I) in g's dtype, C-contiguous
    backward(g, u, dp, dg, du)        # writes dg = d/dg, du = d/du of sum(p * dp)
"""
from __future__ import annotations

import numpy as np

from ..layout import cdiv
from . import _cache
from . import _specs as sp
from ._launch import adapter_of, kind_among, scalars

_KINDS = (sp.BF16, sp.F16)
_SPECS = {(k, b): sp.SiluGateSpec(kind=k, backward=b) for k in _KINDS for b in (False, True)}
_CHUNK = 16


def _kind(ad, x, dtype):
    return kind_among(ad, x, dtype, _KINDS)


def _fits(ad, x, shape, dtype, kind):
    """x is an (M, I) array like the first operand: same dtype and shape, rows contiguous,
    address and row stride multiples of 16 bytes."""
    if x.ndim != 2 or tuple(x.shape) != shape or _kind(ad, x, dtype) != kind:
        return False
    rs, cs = ad.byte_strides(x)
    return (cs == 2 or shape[1] <= 1) and (rs % _CHUNK == 0 or shape[0] <= 1) \
        and ad.ptr(x) % _CHUNK == 0


def serves(*arrays, dtype=None) -> bool:
    """Whether the kernels take these (M, I) operands (g, u[, dp, dg, du]): one device, bf16
    or fp16 alike (``dtype``: the logical dtype of CuPy arrays holding bf16 as uint16), I a
    multiple of 8, rows contiguous, addresses and row strides multiples of 16 bytes."""
    first = arrays[0]
    try:
        ad = adapter_of(first)
    except TypeError:
        return False
    kind = _kind(ad, first, dtype)
    if kind is None or first.ndim != 2 or first.shape[1] % (_CHUNK // 2):
        return False
    device, shape = ad.device_index(first), tuple(first.shape)
    return all(adapter_of(x) is ad and ad.device_index(x) == device
               and _fits(ad, x, shape, dtype, kind) for x in arrays)


def _row_strides(ad, arrays):
    return [ad.byte_strides(x)[0] for x in arrays]


def _check(arrays, dtype, where):
    if not serves(*arrays, dtype=dtype):
        shapes = [tuple(x.shape) for x in arrays]
        raise ValueError(f"silu_gate.{where}: operands must be (M, I) bf16 or fp16 arrays of "
                         f"one shape and dtype on one device, I a multiple of 8, rows "
                         f"contiguous, addresses and row strides multiples of 16 bytes; got "
                         f"shapes {shapes}")


def _launch(ad, spec, arrays, like):
    m, i = like.shape
    chunks = m * (i // 8)
    if chunks == 0:
        return
    args = ad.args(arrays, (np.dtype(np.uint32),) * len(arrays),
                   scalars(m, i // 8, *_row_strides(ad, arrays)))
    kernel = _cache.kernel("silu_gate", spec, ad.device_index(like))
    grid = cdiv(chunks, sp.SILU_THREADS * sp.SILU_ITERS)
    ad.launch(kernel, (grid, 1, 1), (sp.SILU_THREADS, 1, 1), args, like)


def forward(g, u, out=None, dtype=None):
    """p (M, I) = ``silu(g) * u`` in g's dtype on g's device and stream: torch's bytes for
    ``F.silu(g) * u`` (module docstring); written into ``out`` (an (M, I) array like g) when
    given, else into a new C-contiguous array.

    >>> p = forward(h[:, :I], h[:, I:])                  # doctest: +SKIP
    """
    ad = adapter_of(g)
    p = ad.empty(tuple(g.shape), ad.dtype(g), g) if out is None else out
    _check((g, u, p), dtype, "forward")
    _launch(ad, _SPECS[(_kind(ad, g, dtype), False)], (g, u, p), g)
    return p


def backward(g, u, dp, dg, du, dtype=None):
    """Write the gradients of ``silu(g) * u`` for the output gradient dp: ``du = dp *
    silu(g)`` and ``dg = silu_backward(dp * u, g)``, each rounded as autograd's kernels round
    them, into the (M, I) arrays dg and du (views allowed: e.g. the two halves of an (M, 2I)
    buffer); all five operands alike (:func:`serves`). Returns (dg, du).

    >>> dh = torch.empty_like(h)                          # doctest: +SKIP
    >>> backward(h[:, :I], h[:, I:], dp, dh[:, :I], dh[:, I:])   # doctest: +SKIP
    """
    _check((g, u, dp, dg, du), dtype, "backward")
    ad = adapter_of(g)
    _launch(ad, _SPECS[(_kind(ad, g, dtype), True)], (g, u, dp, dg, du), g)
    return dg, du


__all__ = ["forward", "backward", "serves"]
