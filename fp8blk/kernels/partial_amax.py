"""Partial block amaxes of flat master shards, for a whole batch of weights in one launch per
kernel specialization (the GPU side of ``fp8blk.master``; reference:
``fp8blk.reference.partial_amax``). Batch table: ``master_batch``; kernels:
``_partial_amax_kernel``.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from . import _compiled
from . import _specs as sp
from ._launch import Tuning
from ._specs import AMAX2D_THREADS, MXAMAX_THREADS
from .master_batch import batch_for, ptr_arg  # noqa: F401  (batch_for: master's door)

_MODEL_KIND = {np.dtype(np.float32): sp.F32, _arrays.BF16: sp.BF16,
               np.dtype(np.float16): sp.F16}


def model_kind(dtype):
    """The kernels' model-dtype kind (``_specs.F32`` / ``BF16`` / ``F16``) of a numpy dtype
    (float32, bfloat16, float16): the ``model`` argument of the launches here and in
    ``partial_cast``."""
    kind = _MODEL_KIND.get(np.dtype(dtype))
    if kind is None:
        raise TypeError(f"model dtype must be float32, bfloat16 or float16, got {dtype}")
    return kind


_kernels = {}  # (block2d, model, with_col, fast_path) -> kernel
_tuning = Tuning(sp.MasterSettings(), (_kernels,))
use_settings = _tuning.use  # (a tuning.MasterSettings) -> the previous settings


def kernel_for(block2d, model, with_col, fast_path):
    """The partial-amax kernel of a specialization (see ``_partial_amax_kernel``)."""
    key = (block2d, model, with_col, fast_path)
    k = _kernels.get(key)
    if k is None:
        spec = sp.partial_amax_spec(block2d, model, with_col, fast_path, _tuning.settings)
        k = _kernels[key] = _compiled.kernel("partial_amax", spec)
    return k


def launch_partial_amax(batch, buf, model):
    """Partial amaxes (Block2D, fp32) or E8M0 codes (MXFP8, uint8) of every touched block of
    the batch into the zeroed packed `buf`; up to two launches (band rows inside aligned
    shards, the rest) per specialization present. Returns the number of launches."""
    mem32, mem16, _, _ = batch.arena.pointers()
    threads = AMAX2D_THREADS if batch.block2d else MXAMAX_THREADS
    # MXFP8 buffers hold a multiple of 32 codes per weight; Block2D does not use codes32
    codes32 = ptr_arg(buf, np.uint32) if not batch.block2d else ptr_arg(buf, np.float32)
    launches = 0
    for ln in batch.amax_launches:
        launches += ln.launch(
            lambda fast_path: kernel_for(batch.block2d, model, bool(ln.with_col), fast_path),
            threads, (ptr_arg(batch.table_dev, np.int64), np.int64(ln.first),
                      np.int64(ln.count), ptr_arg(buf, buf.dtype), codes32, mem32, mem16))
    return launches
