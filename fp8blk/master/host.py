"""The host path of the master-weight cast (NumPy buffers): the NumPy reference's
``partial_amax`` / ``partial_cast`` per weight, the packed buffer of a bucket, the scales and
the owned bytes written into the weights or the fragments."""
from __future__ import annotations

import numpy as np

from .. import reference, scaling
from ..layout import cdiv


def host_shard(item, model_dtype):
    """The master shard rounded once to the model dtype (fp32 -> bf16/fp16 is RNE; values
    beyond the model dtype's range become inf, as in the unsharded model)."""
    with np.errstate(over="ignore"):
        return item.master.astype(np.float32).astype(model_dtype)


def host_pack(bucket, shards, block2d):
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


def host_finish_block2d(bucket, shards, buf, value_for_inf, have_fragments):
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


def host_finish_mxfp8(bucket, shards, buf):
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


__all__ = ["host_shard", "host_pack", "host_finish_block2d", "host_finish_mxfp8"]
