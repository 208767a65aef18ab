"""GPU ``dequantize``: the launcher of ``_dequantize_kernel``, ``fl32(decode(byte) *
scale_inv)`` rounded once to fp32/bf16/fp16 from rowwise buffers if given, else columnwise ones
(same contract and bytes as the reference): the kernel path (:func:`choose_path`), a launch plan
per call signature, :func:`use_settings`.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .._arrays import BF16
from ..formats import E4M3
from ..formats import recipe_kind
from ..layout import cdiv
from . import _cache
from . import _specs as sp
from ._launch import Tuning, adapter_of, cached_plan, plan_cache, scalars
from ._specs import (BF16_OUT, BX, BY, DQ_THREADS, DQ_TILE, F16_OUT, F32_OUT, MAX_GRID_Y, PIECE,
                     ROWS, SCALAR, SIM, TILES, DequantizeSpec, piece_of, transposed)

_OUT = {np.dtype(np.float32): F32_OUT, BF16: BF16_OUT, np.dtype(np.float16): F16_OUT}


# (recipe kind, columnwise, e4m3, out kind, M, K, ld, data address % 16, sinv address % 16,
# device) -> _Plan
_plans = plan_cache()
_tuning = Tuning(sp.DequantizeSettings(), (_plans,))
use_settings = _tuning.use  # (a backend.DequantizeSettings) -> the previous settings


def lpr_shift(spec, cols):
    """log2 of the lanes per row of the rows kernel: enough for a row's pieces, at most 32."""
    pieces = cdiv(cols, piece_of(spec))
    s = 0
    while s < 5 and (1 << s) < pieces:
        s += 1
    return s


def choose_path(spec, rows, cols, ld, data_align, sinv_align):
    """`spec` with path, piece and aligned set: ROWS / TILES when the shape and alignment
    allow the vector kernels, else SCALAR. Pieces are full (16-byte stores) when K allows,
    else half (8-byte stores) for Block1D / Block2D 16-bit outputs with K % 4 == 0 (and,
    rows kernel, 4-aligned data; MXFP8 has K % 32 == 0). The TILES kernel reads
    rows of any alignment (``aligned=False``: shifted 16-byte loads). ``data_align`` /
    ``sinv_align``: the buffers' addresses modulo 16; the given path / piece are ignored."""
    E = PIECE[spec.out_kind]
    scalar = replace(spec, path=SCALAR, piece=0, aligned=True)
    # the rows kernel's loads need the data aligned to the piece; the tiles kernel's don't
    align = 0 if transposed(spec) else data_align
    if cols % E == 0 and align % E == 0:
        piece = 0
    elif (spec.out_kind != F32_OUT and spec.recipe != sp.MXFP8 and cols % 4 == 0
          and align % 4 == 0):
        piece = 4
    else:
        return scalar
    E = piece or E
    if transposed(spec):
        return replace(spec, path=TILES, piece=piece,
                             aligned=rows % 16 == 0 and data_align == 0)
    if spec.recipe == sp.MXFP8 and spec.columnwise and (sinv_align % E or ld % E):
        return scalar
    return replace(spec, path=ROWS, piece=piece, aligned=True)


class _Plan:
    """Everything about a dequantize call that depends only on its key: the kernel, launch
    shape, scalar arguments and the element types of the pointer arguments (for the
    simulator's views). Built once per key, so a call does one dict lookup, one allocation
    and one launch."""

    __slots__ = ("spec", "kernel", "grid", "block", "scalars", "arg_dtypes")

    def __init__(self, recipe_kind, columnwise, e4m3, out_kind, rows, cols, ld, data_align,
                 sinv_align, device):
        spec = DequantizeSpec(recipe_kind, bool(columnwise), bool(e4m3), out_kind, None,
                              rows_per_thread=_tuning.settings.rows_per_thread)
        spec = self.spec = choose_path(spec, rows, cols, ld, data_align, sinv_align)
        self.kernel = _cache.kernel("dequantize", spec, device)
        values = [rows, cols, ld]
        if spec.path == ROWS:
            s = lpr_shift(spec, cols)
            rows_per_cta = (DQ_THREADS >> s) * spec.rows_per_thread
            self.grid = (cdiv(cols, piece_of(spec) << s),
                         min(cdiv(rows, rows_per_cta), MAX_GRID_Y), 1)
            self.block = (DQ_THREADS, 1, 1)
            values.append(s)
        elif spec.path == TILES:
            self.grid = (cdiv(rows, DQ_TILE), min(cdiv(cols, DQ_TILE), MAX_GRID_Y), 1)
            self.block = (DQ_THREADS, 1, 1)
        else:
            along, across = (rows, cols) if transposed(spec) else (cols, rows)
            self.grid = (cdiv(along, BX), min(cdiv(across, BY), MAX_GRID_Y), 1)
            self.block = (BX, BY, 1)
        self.scalars = scalars(*values)
        self.arg_dtypes = _cache.arg_dtypes("dequantize", spec, 3) if SIM else (None,) * 3




def plan_for(recipe, columnwise, out_kind, rows, cols, data, sinv):
    """The cached :class:`_Plan` of a call (public for tests and benchmarks)."""
    ad = adapter_of(data)
    key = (recipe_kind(recipe), columnwise, recipe.fmt is E4M3, out_kind,
           rows, cols, sinv.shape[1], ad.ptr(data) % 16, ad.ptr(sinv) % 16, ad.device_index(data))
    return cached_plan(_plans, key, _Plan)


def dequantize(recipe, shape2d, rowwise_data=None, rowwise_scale_inv=None,
               columnwise_data=None, columnwise_scale_inv=None, dtype=np.float32):
    """(M, K) device array of `dtype` from rowwise buffers if given, else columnwise ones
    (docs/layouts.md layouts, C-contiguous), without synchronizing: a CuPy array (bf16 returned as
    uint16 bit patterns) or, for torch CUDA buffers, a torch tensor of the dtype itself."""
    rows, cols = shape2d
    if rowwise_data is not None:
        data, sinv, columnwise = rowwise_data, rowwise_scale_inv, False
    elif columnwise_data is not None:
        data, sinv, columnwise = columnwise_data, columnwise_scale_inv, True
    else:
        raise ValueError("nothing to dequantize: the tensor holds neither rowwise nor "
                         "columnwise data")
    out_kind = _OUT.get(np.dtype(dtype))
    if out_kind is None:
        raise TypeError(f"dequantize dtype must be float32, bfloat16 or float16, got {dtype}")
    ad = adapter_of(data)
    # the stored dtype: CuPy holds bf16 as uint16 (the adapter does that for BF16)
    out = ad.empty((rows, cols), np.dtype(dtype), data)
    if rows and cols:
        if not (ad.contiguous(data) and ad.contiguous(sinv)):
            raise ValueError("dequantize needs C-contiguous data and scale_inv buffers")
        plan = plan_for(recipe, columnwise, out_kind, rows, cols, data, sinv)
        args = ad.args((data, sinv, out), plan.arg_dtypes, plan.scalars)
        ad.launch(plan.kernel, plan.grid, plan.block, args, data)
    return out
