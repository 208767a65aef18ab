"""The cast of a validated batch: per recipe bucket (Block2D, then MXFP8) the packed partial
amaxes, ONE all-reduce, the scales and the cast, on the host (:mod:`fp8blk.master.host`) or with
the CUDA kernels (``fp8blk.kernels.partial_amax`` / ``partial_cast``)."""
from __future__ import annotations

import numpy as np

from .. import scaling
from ..formats import Block2D, MXFP8
from .host import host_finish_block2d, host_finish_mxfp8, host_pack, host_shard


def cast_batch(items, comm, model_dtype, have_fragments, device, first_comm=None):
    """Steps 1-5 for validated items: per bucket (Block2D, then MXFP8) pack, ONE all-reduce,
    scales, cast. ``device`` selects the CUDA kernels (CuPy buffers, or NumPy buffers under
    the Numba simulator in tests) instead of the NumPy reference. ``first_comm`` (if given)
    makes the first bucket's all-reduce (the rank agreement's header rides on it)."""
    value_for_inf = scaling.dtype_max(model_dtype)
    for bucket_type in (Block2D, MXFP8):
        bucket = [it for it in items if isinstance(it.recipe, bucket_type)]
        if not bucket:
            continue
        bucket_comm = comm if first_comm is None else first_comm
        first_comm = None
        if device:
            _device_bucket(bucket, bucket_comm, model_dtype, value_for_inf, have_fragments)
            continue
        shards = [host_shard(it, model_dtype) if it.count else None for it in bucket]
        block2d = bucket_type is Block2D
        buf = host_pack(bucket, shards, block2d=block2d)
        _all_reduce_max(bucket_comm, buf)
        if block2d:
            host_finish_block2d(bucket, shards, buf, value_for_inf, have_fragments)
        else:
            host_finish_mxfp8(bucket, shards, buf)


def _all_reduce_max(comm, buf):
    """MAX over ranks of a packed buffer, in place: uint8 E8M0 codes as they are, fp32 amaxes
    as their int32 bit patterns. Amaxes are >= 0 and never NaN, so the patterns order like the
    values (+0 lowest, +inf highest) and the integer MAX is exact for every amax -- including
    subnormal ones (a tile of NaNs, zeros and values like 2**-133), which a float MAX built
    with flush-to-zero turns into 0 (CuPy reductions use ``-ftz=true``)."""
    if buf.dtype == np.float32:
        buf = buf.view(np.int32)
    comm.all_reduce(buf, op="max")


def _device_bucket(bucket, comm, model_dtype, value_for_inf, have_fragments):
    """GPU path of one bucket: zeroed packed buffer, partial-amax kernel(s), the all-reduce,
    scale kernel, cast kernel(s) -- a constant number of launches for any batch size (see
    fp8blk.kernels.partial_amax for the batch table)."""
    from ..kernels import partial_amax, partial_cast

    model = partial_amax.model_kind(model_dtype)
    batch = partial_amax.batch_for(bucket, have_fragments)
    buf = batch.new_buffer()
    partial_amax.launch_partial_amax(batch, buf, model)
    _all_reduce_max(comm, buf)
    scales = partial_cast.launch_scales(batch, buf, value_for_inf)
    partial_cast.launch_cast(batch, scales if batch.block2d else buf, model)
    batch.finish()


__all__ = ["cast_batch"]
