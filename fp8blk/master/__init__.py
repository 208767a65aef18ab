"""Distributed master-weight casts: ``cast_master_weights`` refreshes FP8 weights from flat
master shards with one all-reduce per recipe bucket (Block2D, MXFP8), on the host with the NumPy
reference or on the GPU with ``fp8blk.kernels.partial``. Validation: ``items``; the rank
agreement: ``consensus``. Steps, buckets, storage written and errors: docs/distributed.md.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays, reference, scaling
from ..formats import Block2D, MXFP8
from ..layout import cdiv
from . import consensus
from .items import Item, model_dtype_of, validate



def cast_master_weights(weights, masters, start_offsets, comm, fragments=None,
                        model_dtype=_arrays.BF16):
    """Refresh FP8 weights from flat-sharded master weights, with one all-reduce per bucket.

    Args:
      weights: list of :class:`BlockTensor`, each Block2D or MXFP8 of logical shape (h, w)
        (viewed as (M, K) = shape2d), the same list on every rank. Its buffers are written in
        place: host (NumPy) buffers use the reference path, CuPy buffers the CUDA kernels.
      masters: per weight, this rank's 1-D float32/bfloat16 shard (NumPy, CuPy or torch, on the
        weights' side), or None when the rank owns no element of that weight (it still joins
        the collective).
      start_offsets: per weight, the flat index o of the shard's first element in the row-major
        weight; the shard covers [o, o + len(shard)).
      comm: a communicator with ``rank``, ``size`` and ``all_reduce(buf, op="max")`` in place
        (fp8blk.comm.*). In the steady state exactly one all-reduce is made per bucket present
        (Block2D: int32, the bits of the fp32 amax of every 128x128 tile; MXFP8: uint8, 1 byte
        per 1x32 / 32x1 block of every held direction), the first carrying a 44- / 19-byte
        rank-agreement header.
      fragments: None, or per weight the flat uint8 destination of the owned bytes (Block2D: one
        array of n bytes; MXFP8: a (rowwise, columnwise) pair, None for a direction not held).
        Data bytes are written there instead of into the weight; scales still go to the weight.
      model_dtype: the dtype the model computes in (bf16 default; fp16 or fp32 allowed); every
        master element is rounded to it once before anything else.

    After every rank's call, the bytes each rank wrote at its [o, o+n) positions, put together,
    equal ``quantize(model_dtype(full weight), recipe, ...)`` byte for byte and the scales equal
    quantize's on every rank, for any world size and any shard boundaries (with the overflow
    scale of the model dtype: docs/numerics.md, step 4). Returns None.

    Every rank must pass the same batch: the number of weights, each weight's shape, recipe
    (fmt, pow2_scales, amax_epsilon) and directions held, the model dtype, host or device
    buffers; and the shards of all ranks must tile each weight exactly (with one rank: cover
    it). Otherwise -- or when any rank's own arguments are invalid -- every rank raises (a
    ValueError naming what differs, the rank with invalid arguments its own error) and nothing
    is written: no hang, no error inside MPI/NCCL. This is checked by metadata collectives the
    first time a batch (with its shard ranges) is seen on this communicator, then for free
    (fp8blk.master.consensus). On device buffers with several ranks, the first bucket's header is
    read on the host: one stream synchronize per call.

        import numpy as np, fp8blk as fb
        from fp8blk.comm import MPIComm            # one rank here; under mpiexec, several
        w = fb.quantize(np.zeros((256, 256), np.float32), fb.Block2D())
        shard = np.random.default_rng(0).standard_normal(256 * 256).astype(np.float32)
        fb.cast_master_weights([w], [shard], [0], MPIComm())  # w now holds fp8(bf16(shard))
    """
    if not all(hasattr(comm, a) for a in ("all_reduce", "rank", "size")):
        raise TypeError(f"comm must be a fp8blk communicator (rank, size and all_reduce(buf, "
                        f"op=...)), got {type(comm).__name__}")
    have_fragments = fragments is not None
    if comm.size == 1:
        model_dtype = model_dtype_of(model_dtype)
        items, on_device = validate(weights, masters, start_offsets, fragments)
        for it in items:
            if it.count != it.h * it.w:
                raise ValueError(f"masters[{it.index}] covers [{it.start}, {it.start + it.count})"
                                 f" of the {it.h}x{it.w} weight; with one rank it must cover "
                                 f"all {it.h * it.w} elements (the rest would keep stale bytes)")
        cast_batch(items, comm, model_dtype, have_fragments, on_device)
        return None
    # Several ranks: a rank whose arguments are invalid still joins the first collective, so
    # that every rank raises (fp8blk.master.consensus), instead of leaving the others waiting.
    try:
        model_dtype = model_dtype_of(model_dtype)
        items, on_device = validate(weights, masters, start_offsets, fragments)
        batch, error = consensus.local_batch(items, model_dtype, on_device), None
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank after the exchange
        batch, error = None, exc

    def cast(first_comm):
        cast_batch(items, comm, model_dtype, have_fragments, on_device, first_comm=first_comm)
    consensus.run(comm, batch, error, cast)
    return None


# ---- the cast of a validated batch -------------------------------------------------------

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
        shards = [_host_shard(it, model_dtype) if it.count else None for it in bucket]
        block2d = bucket_type is Block2D
        buf = _host_pack(bucket, shards, block2d=block2d)
        _all_reduce_max(bucket_comm, buf)
        if block2d:
            _host_finish_block2d(bucket, shards, buf, value_for_inf, have_fragments)
        else:
            _host_finish_mxfp8(bucket, shards, buf)


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
    fp8blk.kernels.partial for the batch table)."""
    from ..kernels import partial

    model = partial.model_kind(model_dtype)
    batch = partial.batch_for(bucket, have_fragments)
    buf = batch.new_buffer()
    partial.launch_partial_amax(batch, buf, model)
    _all_reduce_max(comm, buf)
    scales = partial.launch_scales(batch, buf, value_for_inf)
    partial.launch_cast(batch, scales if batch.block2d else buf, model)
    batch.finish()


# ---- the host path (NumPy buffers) ----------------------------------------------------------

def _host_shard(item, model_dtype):
    """The master shard rounded once to the model dtype (fp32 -> bf16/fp16 is RNE; values
    beyond the model dtype's range become inf, as in the unsharded model)."""
    with np.errstate(over="ignore"):
        return item.master.astype(np.float32).astype(model_dtype)


def _host_pack(bucket, shards, block2d):
    total = sum(it.row_blocks + it.col_blocks for it in bucket)
    # Untouched blocks hold amax 0 / E8M0 code 0, the identity of the MAX reduce.
    buf = np.zeros(total, dtype=np.float32 if block2d else np.uint8)
    offset = 0
    for it, shard in zip(bucket, shards):
        nrow, ncol = it.row_blocks, it.col_blocks
        if it.count:
            row, col = reference.partial_amax(shard, (it.h, it.w), it.start, it.recipe,
                                              columnwise=(not block2d) and it.columnwise)
            if block2d:
                buf[offset: offset + nrow] = row.reshape(-1)
            else:
                if it.rowwise:
                    buf[offset: offset + nrow] = scaling.e8m0_from_amax(row, it.recipe.fmt
                                                                        ).reshape(-1)
                if it.columnwise:
                    buf[offset + nrow: offset + nrow + ncol] = scaling.e8m0_from_amax(
                        col, it.recipe.fmt).reshape(-1)
        offset += nrow + ncol
    return buf


def _write_owned(item, data, frag, values, transposed=False):
    """Owned bytes `values` (n,) into the fragment, or into `data` at flat [o, o+n) (or, for
    Block2D columnwise data (w, h), at the transposed positions)."""
    if frag is not None:
        frag[...] = values
    elif not transposed:
        data.reshape(-1)[item.start: item.start + item.count] = values
    else:
        flat = np.arange(item.start, item.start + item.count, dtype=np.int64)
        data.reshape(-1)[(flat % item.w) * item.h + flat // item.w] = values


def _host_finish_block2d(bucket, shards, buf, value_for_inf, have_fragments):
    offset = 0
    for it, shard in zip(bucket, shards):
        mt, kt = cdiv(it.h, 128), cdiv(it.w, 128)
        amax = buf[offset: offset + mt * kt].reshape(mt, kt)
        offset += mt * kt
        r = it.recipe
        scale = scaling.fp32_scale_from_amax(amax, r.fmt, r.pow2_scales, r.amax_epsilon,
                                             value_for_inf)
        scale_inv = scaling.scale_inv_from_scale(scale)
        row_data, row_sinv, col_data, col_sinv = it.buffers()
        if row_sinv is not None:
            row_sinv.fill(1.0)
            row_sinv[:, :kt] = scale_inv
        if col_sinv is not None:
            col_sinv.fill(1.0)
            col_sinv[:, :mt] = scale_inv.T
        if not it.count:
            continue
        data_bytes, _ = reference.partial_cast(shard, (it.h, it.w), it.start, r, scale)
        if it.rowwise:
            _write_owned(it, row_data, it.frag_row, data_bytes)
        if it.columnwise and not have_fragments:
            _write_owned(it, col_data, None, data_bytes, transposed=True)


def _host_finish_mxfp8(bucket, shards, buf):
    offset = 0
    for it, shard in zip(bucket, shards):
        nrow, ncol = it.row_blocks, it.col_blocks
        row_codes = col_codes = None
        row_data, row_sinv, col_data, col_sinv = it.buffers()
        if it.rowwise:
            row_codes = buf[offset: offset + nrow].reshape(it.h, it.w // 32)
            row_sinv.fill(0)
            row_sinv[: it.h, : it.w // 32] = row_codes
        if it.columnwise:
            col_codes = buf[offset + nrow: offset + nrow + ncol].reshape(it.h // 32, it.w)
            col_sinv.fill(0)
            col_sinv[: it.h // 32, : it.w] = col_codes
        offset += nrow + ncol
        if not it.count:
            continue
        # partial_cast always casts rowwise; a column-only weight passes dummy row codes.
        dummy = np.zeros((it.h, it.w // 32), np.uint8) if row_codes is None else row_codes
        row_bytes, col_bytes = reference.partial_cast(shard, (it.h, it.w), it.start, it.recipe,
                                                      dummy, col_codes)
        if it.rowwise:
            _write_owned(it, row_data, it.frag_row, row_bytes)
        if it.columnwise:
            _write_owned(it, col_data, it.frag_col, col_bytes)


__all__ = ["cast_master_weights", "cast_batch", "Item", "validate"]
