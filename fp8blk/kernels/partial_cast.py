"""Scales from reduced amaxes and the partial cast of flat master shards, for a whole batch of
weights per launch (the GPU side of ``fp8blk.master``; reference: ``fp8blk.reference.
partial_cast`` and ``fp8blk.scaling``). Batch table and address space: ``master_batch``;
kernels: ``_partial_cast_kernel``.
"""
from __future__ import annotations

import numpy as np

from . import _compiled
from . import _specs as sp
from ._launch import Tuning
from ._specs import CAST_THREADS, SCALE_THREADS
from .master_batch import ptr_arg

__all__ = ["launch_scales", "launch_cast"]


_kernels = {}  # ("scale", block2d, vinf) / ("cast", block2d, model, with_col, fast) -> kernel
_tuning = Tuning(sp.MasterSettings(), (_kernels,))
use_settings = _tuning.use  # (a tuning.MasterSettings) -> the previous settings


def scale_kernel(block2d, vinf):
    """The scale kernel of a specialization (see ``_partial_cast_kernel``)."""
    key = ("scale", block2d, vinf)
    k = _kernels.get(key)
    if k is None:
        spec = sp.PartialScaleSpec(bool(block2d), float(vinf))
        k = _kernels[key] = _compiled.kernel("partial_scale", spec)
    return k


def cast_kernel(block2d, model, with_col, fast_path):
    """The cast kernel of a specialization (see ``_partial_cast_kernel``)."""
    key = ("cast", block2d, model, with_col, fast_path)
    k = _kernels.get(key)
    if k is None:
        spec = sp.partial_cast_spec(block2d, model, with_col, fast_path, _tuning.settings)
        k = _kernels[key] = _compiled.kernel("partial_cast", spec)
    return k


def launch_scales(batch, buf, vinf):
    """Write every weight's scale_inv (with padding) from the reduced `buf`; for Block2D also
    return the packed fp32 scales the cast reads (None for MXFP8, which casts from the codes)."""
    scales = batch.xp.empty(batch.buf_entries, np.float32) if batch.block2d else None
    if batch.scale_entries:
        _, _, mem8, memf = batch.arena.pointers()
        kernel = scale_kernel(batch.block2d, float(vinf) if batch.block2d else 0.0)
        grid = ((batch.scale_entries + SCALE_THREADS - 1) // SCALE_THREADS, 1, 1)
        head = (ptr_arg(batch.table_dev, np.int64), np.int64(0), np.int64(batch.n_items),
                np.int64(batch.scale_entries))
        if batch.block2d:
            kernel(grid, (SCALE_THREADS, 1, 1),
                   head + (ptr_arg(buf, np.float32), ptr_arg(scales, np.float32), memf))
        else:
            kernel(grid, (SCALE_THREADS, 1, 1), head + (ptr_arg(buf, np.uint8), mem8))
    return scales



def launch_cast(batch, sbuf, model):
    """Cast every owned element of the batch: `sbuf` is the packed fp32 scales (Block2D) or the
    reduced E8M0 codes (MXFP8). Up to two launches (full chunks of aligned shards, the rest)
    per specialization present; returns the count."""
    mem32, mem16, mem8, _ = batch.arena.pointers()
    codes32 = ptr_arg(sbuf, np.float32 if batch.block2d else np.uint32)  # unused by Block2D
    launches = 0
    for ln in batch.cast_launches:
        launches += ln.launch(
            lambda fast_path: cast_kernel(batch.block2d, model, bool(ln.with_col), fast_path),
            CAST_THREADS, (ptr_arg(batch.table_dev, np.int64), np.int64(ln.first),
                           np.int64(ln.count), ptr_arg(sbuf, sbuf.dtype), codes32, mem32,
                           mem16, mem8))
    return launches
