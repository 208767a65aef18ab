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

from .. import _arrays
from . import agree
from .cast import cast_batch
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
    quantize's on every rank, for any world size and any shard boundaries (with the overflow-scale
    rule described in the module docstring). Returns None.

    Every rank must pass the same batch: the number of weights, each weight's shape, recipe
    (fmt, pow2_scales, amax_epsilon) and directions held, the model dtype, host or device
    buffers; and the shards of all ranks must tile each weight exactly (with one rank: cover
    it). Otherwise -- or when any rank's own arguments are invalid -- every rank raises (a
    ValueError naming what differs, the rank with invalid arguments its own error) and nothing
    is written: no hang, no error inside MPI/NCCL. This is checked by metadata collectives the
    first time a batch (with its shard ranges) is seen on this communicator, then for free
    (fp8blk.master.agree). On device buffers with several ranks, the first bucket's header is
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
    # that every rank raises (fp8blk.master.agree), instead of leaving the others waiting.
    try:
        model_dtype = model_dtype_of(model_dtype)
        items, on_device = validate(weights, masters, start_offsets, fragments)
        batch, error = agree.local_batch(items, model_dtype, on_device), None
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank after the exchange
        batch, error = None, exc

    def cast(first_comm):
        cast_batch(items, comm, model_dtype, have_fragments, on_device, first_comm=first_comm)
    agree.run(comm, batch, error, cast)
    return None


__all__ = ["cast_master_weights", "cast_batch", "Item", "validate"]
