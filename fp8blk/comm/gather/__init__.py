"""Quantized all-gather along dim 0 (docs/distributed.md): ``gather_along_first_dim``.

Rank r holds x_r of shape (d_r, *rest) (the same ``rest`` everywhere; viewed as (m_r, K) with
m_r = d_r * prod(rest[:-1])). The result is the tensor of shape (sum d_r, *rest) that
``fb.quantize(concatenate(x_0, ..., x_{n-1}), recipe, rowwise, columnwise)`` returns, byte for
byte, on every rank.

Paths (:mod:`fp8blk.comm.gather.paths`; ``comm.stats.last_gather_path`` /
``comm.stats.gather_paths`` record which one ran):

``"fast"``      each rank quantizes its shard straight into its slot of the gathered output
                (the FP8 rows of rank r are a contiguous slice of the (M, K) data), and the
                data and scales of all ranks move in ONE grouped collective (NCCL: an in-place
                ncclAllGather per buffer for equal shards, a group of broadcasts for unequal
                ones; MPI: in-place Iallgather(v); torch: one all_gather_into_tensor of the
                parts packed per rank, up to ``TorchComm.coalesce_limit``). A fix-up then puts what the layout interleaves in place (the Block1D
                rowwise scales (cdiv(K,128), round4(M)) whose columns are the ranks' rows;
                Block1D columnwise data (K, M): both gathered rank-major into a staging
                buffer) and writes the scale padding (1.0 fp32, 0 E8M0). On the device that
                is one cudaMemcpy2DAsync per rank and staged buffer, a cudaMemsetAsync per
                zero padding and a 2-D copy from a constant block for the 1.0 padding, worked
                out once per set of output buffers (:mod:`fp8blk.comm.gather.fixup` with
                :mod:`fp8blk.comm.gather.copies`); on the host, copies between strided views.
                Block2D gathers rowwise only and derives columnwise by FP8 transpose. A
                BlockTensor input sends its own bytes.
``"fallback"``  where a shard cannot be quantized on its own: a block would cross a rank
                boundary (Block1D columnwise or any Block2D with a non-empty rank whose first
                row is not a multiple of 128; MXFP8 columnwise with a local row count that is
                not a multiple of 32), or a BlockTensor input lacks a direction its recipe
                cannot derive. An array's high-precision data is gathered and quantized after
                the gather (2-4x the traffic, same result). A BlockTensor keeps the bytes its
                ranks hold: a direction every rank holds, whose blocks lie within one rank's
                rows, moves as its FP8 bytes and scales; the others asked for are derived
                after the gather, quantized from the values of the direction every rank
                holds (the dequantize of the gathered kept bytes, or the ranks' dequantized
                shards gathered in high precision when none is kept; docs/distributed.md
                gives the rule). A GatherFallbackWarning is issued once per call site.
``"plain"``     no recipe and an array input: a plain all-gather along dim 0 (any dtype, any
                number of dims, 1-D included; the ranks' dim 0 may differ).

Rowwise-only Block1D is always fast (its 1x128 blocks never cross rows), as is rowwise-only
MXFP8 from high-precision input (a shard whose row count is not a multiple of 32 is padded with
zero rows before its local quantize; the pad rows are not sent).

Metadata: the ranks must agree on the shape after dim 0, dtype, recipe, usage and input kind.
The first call of each configuration exchanges a few int64 per rank (``meta_calls``) and every
rank raises the same ValueError if anything disagrees, or if any rank's input is invalid (no
rank is left waiting). The resulting plan is cached per communicator: later calls cost one
16-byte host all-reduce (a check that every rank found the same plan), or nothing at all with
``sizes=`` (see :mod:`fp8blk.comm.gather.plan` for the protocol). World size 1 never
exchanges anything. With ``sizes=`` and a plan for them, a rank whose input is invalid (or
whose rows no longer match) cannot reach its peers through metadata they skip: it joins their
data collectives with zeros and a nonzero in-band status and raises at once (see
:mod:`fp8blk.comm.gather.errors`). So does a rank whose own ``sizes`` is malformed, joining the
latest ``sizes=`` plan of its input. Every data collective of a ``sizes=`` plan carries that
status (8 bytes per rank in the same grouped collective, :mod:`fp8blk.comm.gather.status`), so
every peer raises a ValueError naming the rank(s): host arrays (MPI, gloo) in the same call
(an asynchronous one in ``wait()``); device arrays, whose status reaches the host only through
a copy and an event (no host synchronization on the steady state), at the end of the next
gather call on that communicator (after it issued its collectives), in an asynchronous call's
``wait()``, or in :func:`check_pending`, which blocks until every pending status is back. The
rows gathered from the bad rank are zeros. Limit: a rank passing well-formed ``sizes`` that
differ from its peers' (a stale list) while they hit their plan cannot be told from a rank whose
peers changed their sizes too, so it takes the metadata probe while they issue data collectives:
that mismatch can hang (real MPI/NCCL) or raise in the backend; pass the same ``sizes``
everywhere.

Steady state: with ``sizes=`` and ``out=``, a call that repeats the last such call into the
same ``out`` (equal recipe, usages and sizes; an input of the same type, dtype, shape and
device, C-contiguous; ``out`` holding the same buffers; the same stream) skips the input
checks, the plan lookup and the output checks: it quantizes into the kept buffers, issues the
collective with its arguments worked out before and replays the fix-up (see
:mod:`fp8blk.comm.gather.lane`). Anything else takes the checked path, which keeps the record
for the next call.

Streams (device arrays, :mod:`fp8blk.comm.gather.streams`): the local quantize runs on the
current stream; the collective and the fix-up step run on ``stream`` (default: the current
stream), which first waits for the current stream. A synchronous call returns once everything is
enqueued (the current stream then waits for ``stream``; on the current stream itself no stream
objects or events are made); with ``async_op=True`` the returned Handle's ``wait()`` makes the
then-current stream wait for an event: no host synchronization, no Python callbacks. Host
backends (MPI, gloo) complete on the host: an asynchronous handle's ``wait()`` finishes the
collective and the fix-up.

Inputs may be strided (array inputs are copied to C-contiguous first). The returned BlockTensor
(or array) is in the input's array family (NumPy, CuPy or torch) and on its device.
"""
from __future__ import annotations

import sys

from ... import _arrays
from ..base import Communicator, Handle
from .errors import GatherFallbackWarning, join_with_zeros, warn_once
from .lane import gather_steady, steady_lane
from .lookup import resolve
from .paths import data_ops, gather_fallback, gather_fast, gather_plain
from .plan import FALLBACK, FAST, PLAIN
from .state import cached_plans, plan_cache, record_path
from .status import check_pending, settle
from .streams import NULL



def gather_along_first_dim(x, comm, recipe=None, rowwise=True, columnwise=False,
                           async_op=False, sizes=None, out=None, stream=None):
    """All-gather ``x`` along dim 0 over ``comm``, quantized.

    ``x``: a high-precision array (..., K) (NumPy, CuPy or torch; float32/bfloat16/float16
    when quantizing, any dtype without a recipe) or a :class:`fp8blk.BlockTensor`.
    ``recipe``: the recipe to quantize with (None: a BlockTensor keeps its own; an array is
    gathered as it is). ``rowwise`` / ``columnwise``: the usages the result holds.
    ``sizes``: dim-0 rows of every rank, if the caller knows them (the same list on every
    rank; pass it on every rank or on none); after its first (checked) use no metadata moves
    at all.
    ``out``: a BlockTensor (or array, without a recipe) of the gathered shape, recipe and
    usage to write into (reused across calls: no allocation).
    ``stream``: the CuPy or torch CUDA stream the collective and the fix-up run on (device
    arrays; default the current stream).

    Returns ``(out, handle)``: ``out`` is the BlockTensor (or array) of shape
    (sum of the ranks' dim 0, *x.shape[1:]); ``handle`` is None, or with ``async_op`` a
    Handle whose ``wait()`` must be called before ``out`` is read (on the device it makes the
    current stream wait for an event; it returns ``out``). See the module docstring.

    >>> import numpy as np, fp8blk as fb
    >>> from mpi4py import MPI
    >>> comm = fb.comm.MPIComm(MPI.COMM_WORLD)
    >>> x = np.random.default_rng(comm.rank).standard_normal((256, 512), np.float32)
    >>> q, _ = fb.comm.gather_along_first_dim(x, comm, fb.Block1D())
    >>> q.shape == (256 * comm.size, 512)
    True
    """
    if out is not None and sizes is not None and isinstance(comm, Communicator):
        steady = steady_lane(comm, x, recipe, rowwise, columnwise, sizes, out, async_op,
                             stream)
        if steady is not None:  # the same call as the last one into out, on new data
            return gather_steady(comm, steady[0], x, async_op, steady[1], steady[2])
    frame = sys._getframe(1)
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an fp8blk communicator (MPIComm, NCCLComm, "
                        f"TorchComm), got {type(comm).__name__}")
    src, plan, local_error, sizes = resolve(comm, x, recipe, rowwise, columnwise, sizes,
                                            out)
    record_path(comm, plan.path)
    with _on_device_of(src):
        result, handle = _gather(comm, src, plan, local_error, async_op, out, stream, sizes,
                                 frame)
    return settle(cached_plans(comm), result, handle)


def _on_device_of(src):
    """CuPy's current device set to the input's GPU for the call (CuPy allocates and launches
    on its current device, which a torch program's torch.cuda.set_device does not move)."""
    if not src.device:
        return NULL
    some = src.x if src.kind == 0 else next(b for b in src.buffers if b is not None)
    if _arrays.is_torch(some):
        return NULL  # torch arrays: torch allocates on the input's device
    import cupy

    device = some.device.id
    if device == cupy.cuda.runtime.getDevice():
        return NULL
    return cupy.cuda.Device(device)


def _gather(comm, src, plan, local_error, async_op, out, stream, sizes, frame):
    if local_error is not None:
        join_with_zeros(comm, plan, data_ops(plan, src))
        raise local_error
    if plan.path == PLAIN:
        result, handle = gather_plain(comm, src, plan, out, async_op, stream)
    elif plan.path == FAST:
        result, handle = gather_fast(comm, src, plan, out, async_op, stream, sizes)
    else:
        warn_once((frame.f_code.co_filename, frame.f_lineno),
                  f"gather_along_first_dim: {plan.reason}; gathering {src.dtype} data and "
                  f"quantizing after the gather (the same bytes, more traffic)")
        result, handle = gather_fallback(comm, src, plan, out, async_op, stream)
    if async_op:
        return result, handle if handle is not None else Handle.completed(result)
    return result, None


__all__ = ["gather_along_first_dim", "check_pending", "GatherFallbackWarning", "plan_cache",
           "FAST", "FALLBACK", "PLAIN"]

