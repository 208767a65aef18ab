"""Distributed master-weight casts: ``cast_master_weights`` (docs/distributed.md).

A ZeRO/FSDP-style optimizer keeps an fp32 *master* copy of every weight, sharded flat across
ranks: rank r holds elements [o_r, o_r + n_r) of the row-major (h, w) weight. After each step the
FP8 model weights must be refreshed so that, once the ranks' bytes are gathered, every weight is
exactly ``quantize(model_dtype(full master weight))``. Block scales depend on whole blocks, which
shards cut arbitrarily, so the steps are:

1. round each shard to the model dtype (bf16 by default), as the unsharded model would hold it;
2. partial amax of every block the shard touches, packed for ALL weights of a recipe bucket into
   one buffer (blocks of all weights, whether this rank touches them or not);
3. ONE ``comm.all_reduce(buffer, op="max")`` per bucket;
4. scales from the reduced amaxes, written into every weight's scale_inv storage (all ranks
   write the same, complete scales, padding as docs/layouts.md);
5. cast of the owned elements into the weight's data storage, or into caller-given fragments.

Buckets (at most two collectives per call, in this order):

* Block2D (any fmt / pow2 / epsilon): fp32 tile amaxes, reduced as their int32 bit patterns
  (amaxes are >= 0 and never NaN, so the bits order like the values and integer MAX is exact;
  a float MAX may flush subnormal amaxes to 0 -- CuPy's reductions are compiled with
  ``-ftz=true`` -- which would give such a tile scale 1 instead of the overflow scale).
* MXFP8 (any fmt): each rank turns its partial amaxes into 1-byte E8M0 codes *before* the
  reduce; codes are monotone in amax, so the MAX of codes is the code of the MAX, and the
  payload is half that of bf16 amaxes.

Block amaxes are TE's ``fmaxf`` reduction started at 0 (docs/numerics.md, reference.block_amax): NaN is
ignored, an all-NaN block has amax 0, and a block this rank does not touch contributes 0. So no
buffer ever holds NaN and a plain MAX (MPI's, NCCL's, or of E8M0 codes, where amax 0 is code 0)
over ranks is exact, whatever the shard boundaries -- including all-NaN blocks split across ranks.

Overflow scale (docs/numerics.md step 4): when ``F / amax`` overflows fp32 (amax below ~F/FLT_MAX,
only reachable with bf16 or fp32 model weights), ``quantize`` uses the input dtype's largest
value. This module uses the *model dtype's* largest value -- FLT_MAX for fp32, 3.3895e38 for
bf16 -- so that the result equals ``quantize(model_dtype(full weight))`` byte for byte for every
recipe. The two choices coincide whenever ``pow2_scales=True`` (both truncate to 2**127),
``model_dtype`` is fp32 or fp16, or no tile amax is below ~1.3e-36 (E4M3) / ~1.7e-34 (E5M2).
TE's master path uses FLT_MAX unconditionally, so with bf16 model weights, pow2_scales=False
and such a tiny tile it differs from TE's master cast (and agrees with TE's quantize).

Storage written per weight (its buffers row_data, row_sinv, col_data, col_sinv; torch CUDA
buffers through CuPy views of the same memory, ``tensor.cupy_buffers``):

* Block2D: rowwise data at flat [o, o+n); if the weight holds columnwise (transposed) data, the
  owned elements' bytes at their transposed positions too; every scale_inv buffer held.
* MXFP8: rowwise data at flat [o, o+n) and, if held, columnwise data at flat [o, o+n) (both are
  (h, w)); every scale_inv buffer held. Row-only weights pack and write rowwise only.
* With ``fragments``, data bytes go to the fragments instead and the weight's data buffers are
  not touched (scales are still written into the weight). For Block2D a fragment is one uint8
  array of n bytes (the rowwise bytes [o, o+n)); Block2D transposed columnwise data is then not
  written (derive it after the gather with ``create_columnwise``). For MXFP8 a fragment is a
  ``(row, col)`` pair, each n bytes or None for a direction the weight does not hold.

Execution: host (NumPy) buffers run the NumPy reference (``reference.partial_amax`` /
``partial_cast``); CuPy buffers run the CUDA kernels of ``fp8blk.kernels.partial_amax`` and
``partial_cast``, asynchronously on CuPy's current stream. Per bucket that is one memset, one
partial-amax launch per kernel specialization present (row-only / with columnwise), the
collective, one scale launch and one cast launch per specialization: a constant number for any
number of weights (a table of per-weight offsets drives each launch).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _arrays, _master_agree, reference, scaling
from .formats import Block1D, Block2D, MXFP8
from .layout import buffer_layouts, cdiv
from .tensor import BlockTensor, cupy_buffers

_MODEL_DTYPES = (np.dtype(np.float32), _arrays.BF16, np.dtype(np.float16))
_MASTER_DTYPES = (np.dtype(np.float32), _arrays.BF16)


@dataclass
class Item:
    """One weight of a batch, validated. ``master`` is the internal 1-D array (NumPy or CuPy)
    or None; ``count`` is its length (0 for None)."""

    index: int
    weight: BlockTensor
    h: int
    w: int
    recipe: object
    master: object
    master_dtype: object  # logical dtype of `master` (device bf16 arrays are uint16)
    start: int
    count: int
    rowwise: bool  # the weight holds this direction (data or fragment is written)
    columnwise: bool
    frag_row: object = None  # internal uint8 (n,) arrays when fragments are given
    frag_col: object = None

    @property
    def row_blocks(self) -> int:
        """Entries this weight contributes to its bucket's rowwise part of the buffer."""
        if isinstance(self.recipe, Block2D):
            return cdiv(self.h, 128) * cdiv(self.w, 128)
        return self.h * (self.w // 32) if self.rowwise else 0

    @property
    def col_blocks(self) -> int:
        if isinstance(self.recipe, Block2D):
            return 0
        return (self.h // 32) * self.w if self.columnwise else 0


# --------------------------------------------------------------------------------------------
# Validation


def _as_list(value, name):
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"{name} must be a list or tuple (one entry per weight), got "
                    f"{type(value).__name__}")


def _model_dtype(model_dtype):
    try:
        dtype = _arrays.numpy_dtype(model_dtype)
    except TypeError:
        dtype = None
    if dtype not in _MODEL_DTYPES:
        raise TypeError(f"model_dtype must be bfloat16, float16 or float32 (NumPy/ml_dtypes, "
                        f"torch or 'bf16'), got {model_dtype!r}")
    return dtype


def _check_buffer(arr, shape, dtype, what, index, on_device):
    if arr is None:
        return
    if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise ValueError(f"weights[{index}] {what} is {arr.dtype}{tuple(arr.shape)}, expected "
                         f"{np.dtype(dtype)}{tuple(shape)} for its shape and recipe (docs/layouts.md)")
    if _arrays.is_device(arr) != on_device:
        raise TypeError(f"weights[{index}] mixes host and device buffers ({what})")
    if not arr.flags.c_contiguous:
        raise ValueError(f"weights[{index}] {what} is not C-contiguous; it must be written in "
                         f"place")
    if not on_device and not arr.flags.writeable:
        raise ValueError(f"weights[{index}] {what} is read-only; it must be written in place")


_BUFFER_NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _check_weight(weight, index, on_device):
    if not isinstance(weight, BlockTensor):
        raise TypeError(f"weights[{index}] must be a fp8blk.BlockTensor, got "
                        f"{type(weight).__name__}")
    recipe = weight.recipe
    if isinstance(recipe, Block1D) or not isinstance(recipe, (Block2D, MXFP8)):
        raise TypeError(f"weights[{index}] has recipe {recipe!r}; cast_master_weights supports "
                        f"Block2D and MXFP8 weights (Block1D's columnwise blocks cross shards "
                        f"and rows; quantize the gathered weight instead)")
    h, w = weight.shape2d
    row_data, row_sinv, col_data, col_sinv = cupy_buffers(weight)
    if (row_data is None) != (row_sinv is None) or (col_data is None) != (col_sinv is None):
        raise ValueError(f"weights[{index}] holds data without scales (or scales without data) "
                         f"in one direction")
    if row_data is None and col_data is None:
        raise ValueError(f"weights[{index}] holds no storage (see BlockTensor.update_usage)")
    if isinstance(recipe, MXFP8) and (h % 32 or w % 32):
        raise ValueError(f"weights[{index}] is MXFP8 of shape {weight.shape}; MXFP8 needs "
                         f"both dims to be multiples of 32")
    layouts = buffer_layouts(recipe, h, w, True, True)
    for buf, layout, what in zip(cupy_buffers(weight), layouts, _BUFFER_NAMES):
        _check_buffer(buf, layout.shape, layout.dtype, what, index, on_device)
    return h, w


def _internal(x, what, on_device):
    """(internal array, logical dtype) of a caller array; checks the host/device side."""
    arr, _, dtype = _arrays.to_backend(x)
    if _arrays.is_device(arr) != on_device:
        side = "device (CuPy / CUDA torch)" if on_device else "host (NumPy / CPU torch)"
        raise TypeError(f"{what} must be on the same side as the weights' buffers: {side}")
    return arr, np.dtype(dtype)


def _check_master(master, index, h, w, start, on_device):
    dtype = None
    if master is None:
        count = 0
        arr = None
    else:
        arr, dtype = _internal(master, f"masters[{index}]", on_device)
        if arr.ndim != 1:
            raise ValueError(f"masters[{index}] must be a flat (1-D) shard of the row-major "
                             f"weight, got shape {tuple(arr.shape)}: pass master.reshape(-1)")
        if dtype not in _MASTER_DTYPES:
            raise TypeError(f"masters[{index}] must be float32 or bfloat16 (on the GPU, pass bf16 "
                            f"as a torch.bfloat16 tensor), got {dtype}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"masters[{index}] must be contiguous")
        count = int(arr.shape[0])
        if count == 0:
            arr = None
    if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)):
        raise TypeError(f"start_offsets[{index}] must be an int, got {start!r}")
    start = int(start)
    if start < 0 or start + count > h * w:
        raise ValueError(f"masters[{index}] covers flat [{start}, {start + count}), outside the "
                         f"{h}x{w} weight (0..{h * w})")
    return arr, dtype, start, count


def _check_fragment(frag, index, what, count, on_device):
    arr, dtype = _internal(frag, f"fragments[{index}]{what}", on_device)
    if dtype != np.uint8 or arr.ndim != 1 or arr.shape[0] != count:
        raise ValueError(f"fragments[{index}]{what} must be a uint8 array of shape ({count},) "
                         f"(the bytes [o, o+n) of the weight), got {dtype}{tuple(arr.shape)}")
    if not arr.flags.c_contiguous or (not on_device and not arr.flags.writeable):
        raise ValueError(f"fragments[{index}]{what} must be contiguous and writable")
    return arr


def _fragments_for(item, frag, on_device):
    i = item.index
    if isinstance(item.recipe, Block2D):
        if isinstance(frag, (tuple, list)):
            raise TypeError(f"fragments[{i}] is for a Block2D weight: pass one uint8 array of "
                            f"the rowwise bytes [o, o+n), not a pair")
        if frag is None:
            if item.count:
                raise ValueError(f"fragments[{i}] is None but masters[{i}] holds {item.count} "
                                 f"elements")
            return
        if not item.rowwise:
            raise ValueError(f"fragments[{i}] covers rowwise bytes, but weights[{i}] holds no "
                             f"rowwise storage")
        item.frag_row = _check_fragment(frag, i, "", item.count, on_device)
        return
    if frag is None:
        if item.count:
            raise ValueError(f"fragments[{i}] is None but masters[{i}] holds {item.count} "
                             f"elements")
        return
    if not isinstance(frag, (tuple, list)) or len(frag) != 2:
        raise TypeError(f"fragments[{i}] is for an MXFP8 weight: pass a (rowwise, columnwise) "
                        f"pair of uint8 arrays (None for a direction the weight does not hold)")
    for held, part, what, attr in ((item.rowwise, frag[0], "[0] (rowwise)", "frag_row"),
                                   (item.columnwise, frag[1], "[1] (columnwise)", "frag_col")):
        if part is None:
            if held and item.count:
                raise ValueError(f"fragments[{i}]{what} is None but weights[{i}] holds that "
                                 f"direction")
            continue
        if not held:
            raise ValueError(f"fragments[{i}]{what} is given but weights[{i}] does not hold "
                             f"that direction")
        setattr(item, attr, _check_fragment(part, i, what, item.count, on_device))


def validate(weights, masters, start_offsets, fragments):
    """Items of a batch, or TypeError/ValueError naming the fix; returns (items, on_device)."""
    weights = _as_list(weights, "weights")
    masters = _as_list(masters, "masters")
    start_offsets = _as_list(start_offsets, "start_offsets")
    if fragments is not None:
        fragments = _as_list(fragments, "fragments")
    lengths = {"weights": len(weights), "masters": len(masters),
               "start_offsets": len(start_offsets)}
    if fragments is not None:
        lengths["fragments"] = len(fragments)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"one entry per weight is needed in every list; got lengths {lengths}")
    on_device = False
    for i, weight in enumerate(weights):
        if isinstance(weight, BlockTensor):
            some = next((b for b in cupy_buffers(weight) if b is not None), None)
            on_device = _arrays.is_device(some) or _arrays.is_torch(some)
            break
    items = []
    for i, weight in enumerate(weights):
        h, w = _check_weight(weight, i, on_device)
        arr, dtype, start, count = _check_master(masters[i], i, h, w, start_offsets[i],
                                                 on_device)
        item = Item(i, weight, h, w, weight.recipe, arr, dtype, start, count,
                    rowwise=cupy_buffers(weight)[0] is not None,
                    columnwise=cupy_buffers(weight)[2] is not None)
        if fragments is not None:
            _fragments_for(item, fragments[i], on_device)
            if not count:  # an empty fragment has no address to write to
                item.frag_row = item.frag_col = None
        items.append(item)
    return items, on_device


# --------------------------------------------------------------------------------------------
# Host path (NumPy reference)


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
        row_data, row_sinv, col_data, col_sinv = cupy_buffers(it.weight)
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
        row_data, row_sinv, col_data, col_sinv = cupy_buffers(it.weight)
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


# --------------------------------------------------------------------------------------------
# Public entry point


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
    quantize's on every rank, for any world size and any shard boundaries (with the overflow-scale
    rule described in the module docstring). Returns None.

    Every rank must pass the same batch: the number of weights, each weight's shape, recipe
    (fmt, pow2_scales, amax_epsilon) and directions held, the model dtype, host or device
    buffers; and the shards of all ranks must tile each weight exactly (with one rank: cover
    it). Otherwise -- or when any rank's own arguments are invalid -- every rank raises (a
    ValueError naming what differs, the rank with invalid arguments its own error) and nothing
    is written: no hang, no error inside MPI/NCCL. This is checked by metadata collectives the
    first time a batch (with its shard ranges) is seen on this communicator, then for free
    (fp8blk._master_agree). On device buffers with several ranks, the first bucket's header is
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
        model_dtype = _model_dtype(model_dtype)
        items, on_device = validate(weights, masters, start_offsets, fragments)
        for it in items:
            if it.count != it.h * it.w:
                raise ValueError(f"masters[{it.index}] covers [{it.start}, {it.start + it.count})"
                                 f" of the {it.h}x{it.w} weight; with one rank it must cover "
                                 f"all {it.h * it.w} elements (the rest would keep stale bytes)")
        cast_batch(items, comm, model_dtype, have_fragments, on_device)
        return None
    # Several ranks: a rank whose arguments are invalid still joins the first collective, so
    # that every rank raises (fp8blk._master_agree), instead of leaving the others waiting.
    try:
        model_dtype = _model_dtype(model_dtype)
        items, on_device = validate(weights, masters, start_offsets, fragments)
        batch, error = _local_batch(items, model_dtype, on_device), None
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank after the exchange
        batch, error = None, exc

    def cast(first_comm):
        cast_batch(items, comm, model_dtype, have_fragments, on_device, first_comm=first_comm)
    _master_agree.run(comm, batch, error, cast)
    return None


def _local_batch(items, model_dtype, on_device):
    """This rank's view of the batch for the rank agreement: per weight (h, w, recipe,
    rowwise, columnwise, start, count), empty shards as (0, 0)."""
    weights = tuple([(it.h, it.w, it.recipe, it.rowwise, it.columnwise,
                      it.start if it.count else 0, it.count) for it in items])

    def first():
        """(on_device, unit dtype, entries) of the first bucket's packed buffer, or None."""
        for bucket_type, unit in ((Block2D, np.int32), (MXFP8, np.uint8)):
            bucket = [it for it in items if isinstance(it.recipe, bucket_type)]
            if bucket:
                return (on_device, np.dtype(unit),
                        sum(it.row_blocks + it.col_blocks for it in bucket))
        return None
    return _master_agree.LocalBatch(weights, _MODEL_DTYPES.index(model_dtype), on_device, first)


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
    with flush-to-zero turns into 0 (CuPy reductions use ``-ftz=true``; found on the H200)."""
    if buf.dtype == np.float32:
        buf = buf.view(np.int32)
    comm.all_reduce(buf, op="max")


def _device_bucket(bucket, comm, model_dtype, value_for_inf, have_fragments):
    """GPU path of one bucket: zeroed packed buffer, partial-amax kernel(s), the all-reduce,
    scale kernel, cast kernel(s) -- a constant number of launches for any batch size (see
    fp8blk.kernels.partial_amax for the batch table)."""
    from .kernels import partial_amax, partial_cast

    model = partial_amax.model_kind(model_dtype)
    batch = partial_amax.batch_for(bucket, have_fragments)
    buf = batch.new_buffer()
    partial_amax.launch_partial_amax(batch, buf, model)
    _all_reduce_max(comm, buf)
    scales = partial_cast.launch_scales(batch, buf, value_for_inf)
    partial_cast.launch_cast(batch, scales if batch.block2d else buf, model)
    batch.finish()
