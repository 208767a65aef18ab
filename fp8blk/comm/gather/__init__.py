"""Quantized all-gather along dim 0 (docs/distributed.md): ``gather_along_first_dim``.

Rank r holds x_r of shape (d_r, *rest) (the same ``rest`` everywhere; viewed as (m_r, K) with
m_r = d_r * prod(rest[:-1])). The result is the tensor of shape (sum d_r, *rest) that
``fb.quantize(concatenate(x_0, ..., x_{n-1}), recipe, rowwise, columnwise)`` returns, byte for
byte, on every rank.

Paths (``comm.stats.last_gather_path`` / ``comm.stats.gather_paths`` record which one ran):

``"fast"``      each rank quantizes its shard straight into its slot of the gathered output
                (the FP8 rows of rank r are a contiguous slice of the (M, K) data), and the
                data and scales of all ranks move in ONE grouped collective (NCCL: an in-place
                ncclAllGather per buffer for equal shards, a group of broadcasts for unequal
                ones; MPI: in-place Iallgather(v); torch: in-place all_gather_into_tensor on
                uint8). A fix-up then puts what the layout interleaves in place (the Block1D
                rowwise scales (cdiv(K,128), round4(M)) whose columns are the ranks' rows;
                Block1D columnwise data (K, M): both gathered rank-major into a staging
                buffer) and writes the scale padding (1.0 fp32, 0 E8M0). On the device that
                is one cudaMemcpy2DAsync per rank and staged buffer, a cudaMemsetAsync per
                zero padding and a 2-D copy from a constant block for the 1.0 padding, worked
                out once per set of output buffers (fp8blk.comm._device_copy); on the host,
                copies between strided views. Block2D gathers rowwise only and derives
                columnwise by FP8 transpose. A BlockTensor input sends its own bytes.
``"fallback"``  where a shard cannot be quantized on its own: a block would cross a rank
                boundary (Block1D columnwise or any Block2D with a non-empty rank whose first
                row is not a multiple of 128; MXFP8 columnwise with a local row count that is
                not a multiple of 32), or a BlockTensor input lacks a direction its recipe
                cannot derive. The high-precision data is gathered and quantized after the
                gather (2-4x the traffic, same result). A BlockTensor input is dequantized (to
                its own dtype) and quantized again, so the result's bytes are those of
                ``quantize(concat of the dequantized shards)``: its values equal what the
                ranks held, its bytes may differ (e.g. a scale recomputed over the gathered
                blocks). A GatherFallbackWarning is issued once per call site.
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
``sizes=`` (see :mod:`fp8blk.comm._gather_plan` for the protocol). World size 1 never
exchanges anything. With ``sizes=`` and a plan for them, a rank whose input is invalid (or
whose rows no longer match) cannot tell its peers, who skip the metadata: it joins their data
collectives with zeros and raises; they complete (see ``_join_peers_and_raise``). A rank whose
own ``sizes`` is malformed cannot find their plan and is left to the exchange they skip.

Steady state: with ``sizes=`` and ``out=``, a call that repeats the last such call into the
same ``out`` (equal recipe, usages and sizes; an input of the same type, dtype, shape and
device, C-contiguous; ``out`` holding the same buffers; the same stream) skips the input
checks, the plan lookup and the output checks: it quantizes into the kept buffers, issues the
collective with its arguments worked out before and replays the fix-up (see ``_Lane``).
Anything else takes the checked path, which keeps the record for the next call.

Streams (device arrays): the local quantize runs on the current stream; the collective and the
fix-up step run on ``stream`` (default: the current stream), which first waits for the current
stream. A synchronous call returns once everything is enqueued (the current stream then waits
for ``stream``; on the current stream itself no stream objects or events are made); with
``async_op=True`` the returned Handle's ``wait()`` makes the then-current stream wait for an
event: no host synchronization, no Python callbacks. Host backends (MPI,
gloo) complete on the host: an asynchronous handle's ``wait()`` finishes the collective and
the fix-up.

Inputs may be strided (array inputs are copied to C-contiguous first). The returned BlockTensor
(or array) is in the input's array family (NumPy, CuPy or torch) and on its device.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np

from .. import _arrays
from .._dispatch import backend_for
from ..formats import Block2D
from ..ops import quantize_into
from ..tensor import BlockTensor, from_internal, internal_buffers
from ._device_copy import uniform_byte
from ._gather_plan import (FALLBACK, FAST, PLAIN, SLOT, Plan, PlanCache, Source, check_sizes,
                           exchange, local_key)
from ._native import (U8, contiguous, internal_ops, logical_dtype, ops_for,
                      torch_stream_ptr)
from .base import Communicator, Handle

ROW, COL = "rowwise", "columnwise"


class GatherFallbackWarning(UserWarning):
    """gather_along_first_dim gathered high-precision data because the FP8 shards could not
    be gathered as they are (same result, more traffic)."""


_warned_sites = set()


def _warn_once(site, message):
    if site in _warned_sites:
        return
    _warned_sites.add(site)
    warnings.warn_explicit(message, GatherFallbackWarning, site[0], site[1])


# --------------------------------------------------------------------------------------------
# Plans: cached per communicator


def plan_cache(comm) -> PlanCache:
    """The plan cache of ``comm`` (created on first use; tests read ``hits``/``misses``)."""
    cache = comm._gather_plans
    if cache is None:
        cache = comm._gather_plans = PlanCache()
    return cache


def _resolve(comm, x, recipe, rowwise, columnwise, sizes, out=None):
    """(source, plan, local_error, sizes as a checked tuple or None): ``local_error`` is set
    only on the ``sizes=`` steady state when this rank's input does not fit the plan its
    peers use. An invalid input with well-formed ``sizes`` for which a plan is known raises
    here, after joining that plan's collectives (:func:`_join_peers_and_raise`)."""
    src, sizes, error = _checked_input(comm, x, recipe, rowwise, columnwise, sizes)
    cache = plan_cache(comm)
    if error is not None and sizes is not None and comm.size > 1:
        _join_peers_and_raise(comm, cache, sizes, out, error)
    key = None if error is not None else local_key(src, sizes)
    plan = None if key is None else cache.get(key)
    if comm.size == 1:
        if error is not None:
            raise error
    elif sizes is not None and plan is not None:
        problem = plan.expects(src)
        cache.hits += 1
        if problem is None:
            cache.note_sizes_call(sizes, plan, _data_ops(plan, src))
        return src, plan, (None if problem is None else ValueError(
            f"gather_along_first_dim: {problem}; this rank joined the collectives with zeros "
            f"so that no rank waits forever (the other ranks received zeros for its rows): "
            f"pass the true sizes")), sizes
    else:
        # The check: MAX of [h, -h] is [h, -h] only when every rank found the same plan. A
        # miss with sizes= makes it too (then exchanges), so that a miss issues the same two
        # host collectives whether or not the ranks passed sizes=.
        mark = plan.table_hash if plan is not None else -1 - comm.rank
        probe = comm._meta_all_reduce_max(np.array([mark, -mark], dtype=np.int64))
        if plan is not None and probe[0] == -probe[1]:
            cache.hits += 1
            return src, plan, None, sizes
        plan = None
    if plan is not None:  # world size 1
        cache.hits += 1
        return src, plan, None, sizes
    cache.misses += 1
    columns, table_hash = exchange(comm, src, sizes, error)
    plan = Plan(src, columns, comm.size, comm.rank, table_hash)
    cache.put(key, plan)
    if sizes is not None and comm.size > 1:
        cache.note_sizes_call(sizes, plan, _data_ops(plan, src))
    return src, plan, None, sizes


def _checked_input(comm, x, recipe, rowwise, columnwise, sizes):
    """(source or None, sizes as a checked tuple or None, this rank's error or None). Sizes
    are checked apart from the input, so that an invalid input still knows them; malformed
    sizes are dropped (that rank then cannot find its peers' plan, see
    :func:`_join_peers_and_raise`)."""
    src = error = None
    try:
        src = Source(x, recipe, rowwise, columnwise)
    except Exception as caught:  # every rank must learn of it, or its peers would wait
        error = caught
    if sizes is not None:
        try:
            sizes = check_sizes(sizes, comm.size)
        except Exception as caught:
            error, sizes = error or caught, None
    return src, sizes, error


# --------------------------------------------------------------------------------------------
# Streams


_torch_external = {}


class _DeviceStreams:
    """The compute (current) stream and the communication stream of one device gather, in
    the flavour of the arrays' family (CuPy streams for CuPy arrays, torch streams for torch
    tensors)."""

    def __init__(self, torch_flavour, stream):
        self.torch_flavour = torch_flavour
        if torch_flavour:
            import torch

            self.lib = torch
            if stream is None:  # the common case: no Stream objects (~5 us each in torch)
                self.compute = self.comm = None
                self.ptr = torch_stream_ptr(torch)
                self.same = True
                return
            self.compute = torch.cuda.current_stream()
            self.comm = _torch_stream(stream)
            self.ptr = self.comm.cuda_stream
            self.same = self.ptr == self.compute.cuda_stream
        else:
            import cupy

            self.lib = cupy
            self.compute = cupy.cuda.get_current_stream()
            self.comm = self.compute if stream is None else _cupy_stream(stream)
            self.ptr = self.comm.ptr
            self.same = self.ptr == self.compute.ptr

    def begin(self):
        """The communication stream waits for the work queued so far (the local quantize)."""
        if not self.same:
            self.comm.wait_event(self._record(self.compute))

    def _record(self, stream):
        if self.torch_flavour:
            return stream.record_event()
        return stream.record()

    def context(self):
        if self.same:
            return _NULL
        if self.torch_flavour:
            return self.lib.cuda.stream(self.comm)
        return self.comm

    def torch_context(self):
        """For torch process groups, which order against torch's current stream."""
        if self.torch_flavour:
            return self.context()
        if self.ptr == 0:
            return _NULL  # the legacy default stream is torch's default stream too
        return _torch().cuda.stream(_torch_stream_for_ptr(self.ptr))

    def end(self, async_op):
        """None (sync: the compute stream waits for the communication stream), or the event
        an asynchronous handle waits for."""
        if not async_op:
            if not self.same:
                self.compute.wait_event(self._record(self.comm))
            return None
        lib = self.lib
        if self.torch_flavour and self.comm is None:
            event = lib.cuda.current_stream().record_event()
        else:
            event = self._record(self.comm)
        if self.torch_flavour:
            return lambda: lib.cuda.current_stream().wait_event(event)
        return lambda: lib.cuda.get_current_stream().wait_event(event)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def _torch():
    return sys.modules["torch"]


def _torch_stream_for_ptr(ptr):
    stream = _torch_external.get(ptr)
    if stream is None:
        stream = _torch_external[ptr] = _torch().cuda.ExternalStream(ptr)
    return stream


def _cupy_stream(stream):
    import cupy

    if isinstance(stream, cupy.cuda.Stream):
        return stream
    ptr = getattr(stream, "cuda_stream", None)
    if ptr is None:
        raise TypeError(f"stream must be a cupy.cuda.Stream or a torch.cuda.Stream, got "
                        f"{type(stream).__name__}")
    return cupy.cuda.ExternalStream(ptr)


def _torch_stream(stream):
    torch = _torch()
    if isinstance(stream, torch.cuda.Stream):
        return stream
    ptr = getattr(stream, "ptr", None)
    if ptr is None:
        raise TypeError(f"stream must be a torch.cuda.Stream or a cupy.cuda.Stream, got "
                        f"{type(stream).__name__}")
    return _torch_stream_for_ptr(ptr)


# --------------------------------------------------------------------------------------------
# Running a plan's collective and its post-processing


def _run(comm, issue, post, streams, ptr, async_op, result, keep=None):
    """Issue the grouped gather (``issue(stream_ptr)``; None: nothing to gather), then
    ``post()`` (the fix-up). ``streams``/``ptr`` as :func:`_streams_for` gives them. Returns
    the Handle (async) or None. ``keep``: the temporaries (staging, inputs) the issued work
    reads or writes; an asynchronous handle holds them until it is waited for, since the
    memory pools would otherwise hand their memory to new work on the caller's stream while
    the communication stream still uses it."""
    if streams is None:
        finish = None if issue is None else issue(ptr)
        if ptr is None and async_op:  # host arrays: complete in wait()
            return Handle(waiter=finish, post=post, result=result)
        # host arrays, or a synchronous device call on the current stream: the collective
        # and the fix-up are plain stream-ordered work there (a host backend staging device
        # arrays completes in finish())
        if finish is not None:
            finish()
        post()
        return None
    stream_ordered = comm._stream_ordered
    streams.begin()
    with streams.context():
        if issue is not None:
            with streams.torch_context() if comm._orders_torch_stream else _NULL:
                finish = issue(streams.ptr)
                if finish is not None and (stream_ordered or not async_op):
                    finish()  # stream-ordered: only makes this stream wait, host goes on
                    finish = None
        else:
            finish = None
        if finish is None:
            post()
    if finish is not None:  # a host backend staging device arrays: complete in wait()
        def complete():
            with streams.context():
                finish()
                post()
            streams.end(False)
            return keep
        return Handle(waiter=complete, result=result)
    waiter = streams.end(async_op)
    if not async_op:  # the caller's stream waits for the communication stream already
        return None
    return Handle(waiter=waiter if keep is None else _holding(waiter, keep), result=result)


def _holding(waiter, keep):
    """``waiter`` that keeps ``keep`` alive for as long as the handle holds it."""
    def wait():
        waiter()
        return keep
    return wait


def _streams_for(comm, ops, stream, async_op):
    """(streams, ptr) of a gather on ``ops``' arrays: (None, None) on the host; (None, the
    current stream's handle) for a synchronous device call on the current stream (no stream
    objects, no events: everything is ordered on that stream as it is enqueued); else the
    call's :class:`_DeviceStreams` and its communication stream's handle. A TorchComm on
    CuPy arrays always takes the streams (torch's current stream must be CuPy's there)."""
    if not ops.device:
        return None, None
    if stream is None and not async_op and not (
            comm._orders_torch_stream and ops.family != _arrays.TORCH):
        return None, ops.current_stream_ptr()
    streams = _DeviceStreams(ops.family == _arrays.TORCH, stream)
    return streams, streams.ptr


def _issuer(comm, items):
    """``issue(stream_ptr)`` of a grouped gather of ``items`` (None when there are none)."""
    return comm._gather_parts_issuer(items) if items else None


# --------------------------------------------------------------------------------------------
# Output buffers


def _internal_ops(src):
    """Operations on the internal arrays the result holds: NumPy on the host, CuPy for CuPy
    input, torch for torch CUDA input (the kernels run on torch tensors natively, on torch's
    current stream, so nothing crosses DLPack)."""
    if not src.device:
        return internal_ops(False)
    some = src.x if src.kind == 0 else next(b for b in src.buffers if b is not None)
    if _arrays.is_torch(some):
        return ops_for(some)
    return internal_ops(True)


def _targets(plan, out, ops):
    """The four output buffers (None where not written): out's, or new ones."""
    layouts = plan.out_layouts
    if out is None:
        return [ops.empty(layouts[i].shape, layouts[i].dtype) if i in plan.targets else None
                for i in range(4)]
    checked = plan.checked_out
    if checked is not None and checked[0] is out:
        held, seen = internal_buffers(out), checked[1]
        if held[0] is seen[0] and held[1] is seen[1] and held[2] is seen[2] \
                and held[3] is seen[3]:
            return list(checked[2])  # the same out, holding the same buffers: checked before
    targets = _check_out(plan, out, ops)
    plan.checked_out = (out, list(internal_buffers(out)), targets)
    return list(targets)


def _check_out(plan, out, ops):
    layouts, wanted = plan.out_layouts, set(plan.targets)
    if not isinstance(out, BlockTensor):
        raise TypeError(f"out must be a fp8blk.BlockTensor when quantizing, got "
                        f"{type(out).__name__}")
    if out.recipe != plan.recipe or tuple(out.shape) != plan.out_shape:
        raise ValueError(f"out is a {type(out.recipe).__name__} BlockTensor of shape "
                         f"{tuple(out.shape)}; this gather gives {plan.recipe!r} of shape "
                         f"{plan.out_shape}")
    if (out.has_rowwise, out.has_columnwise) != (plan.rowwise, plan.columnwise):
        raise ValueError(f"out holds rowwise={out.has_rowwise}, columnwise="
                         f"{out.has_columnwise} buffers; this gather writes rowwise="
                         f"{plan.rowwise}, columnwise={plan.columnwise}")
    if np.dtype(out.dtype) != plan.dtype:
        raise ValueError(f"out.dtype is {out.dtype}, the gathered input's {plan.dtype}")
    held = internal_buffers(out)
    targets = []
    for i in range(4):
        buf = held[i]
        if i not in wanted:
            targets.append(None)
            continue
        if buf is None:  # Block2D columnwise-only: rowwise is scratch
            targets.append(ops.empty(layouts[i].shape, layouts[i].dtype))
            continue
        if ops_for(buf).family != ops.family:
            raise ValueError("out is on another device (or array family) than the input")
        if (tuple(buf.shape) != layouts[i].shape or logical_dtype(buf) != layouts[i].dtype
                or not contiguous(buf) or (ops.device and ops.ptr(buf) % 16)):
            raise ValueError(f"out's buffer {i} must be a C-contiguous, 16-byte aligned "
                             f"{layouts[i].dtype}{layouts[i].shape}")
        targets.append(buf)
    return targets


def _result(plan, src, targets, out):
    if out is not None:
        return out
    final = list(targets)
    if not plan.rowwise:
        final[0] = final[1] = None
    return from_internal(plan.out_shape, plan.recipe, final, src.dtype, src.family)


# --------------------------------------------------------------------------------------------
# Paths


def _local_x2d(x, m, k, rows):
    """The local (rows, K) high-precision array as the quantize backend takes it (``x``: the
    C-contiguous input of m * K elements; rows > m: MXFP8 rowwise pads with zero rows up to a
    multiple of 32, never sent)."""
    if type(x) is not np.ndarray and _arrays.is_torch(x) and not x.is_cuda:
        x = _arrays.to_backend(x)[0]  # a CPU tensor: its NumPy view (no copy)
    x2d = x if x.ndim == 2 else x.reshape(m, k)
    if rows != m:
        if ops_for(x2d).family == _arrays.TORCH:
            padded = x2d.new_zeros((rows, k))
        else:
            padded = (np if isinstance(x2d, np.ndarray) else _arrays.cupy_module()).zeros(
                (rows, k), dtype=x2d.dtype)
        padded[:m] = x2d
        x2d = padded
    return x2d


def _block_sends(src, plan):
    """The BlockTensor input's buffers (Block2D rowwise derived when it holds columnwise)."""
    buffers = list(src.buffers)
    if isinstance(plan.recipe, Block2D) and buffers[0] is None:
        backend = backend_for(buffers[2])
        buffers[0], buffers[1] = backend.block2d_columnwise_from_rowwise(
            buffers[2], buffers[3], out=(None, None))
    return buffers


def _fast(comm, src, plan, out, async_op, stream, sizes):
    ops = _internal_ops(src)
    targets = _targets(plan, out, ops)
    result = _result(plan, src, targets, out)
    streams, ptr = _streams_for(comm, ops, stream, async_op)
    if plan.direct:  # one rank: the output IS the local quantize
        prepared = _Prepared.direct(plan, targets, ptr)
    else:
        prepared = _prepared(comm, plan, src, targets, ops, ptr, out is not None)
    if src.kind == 0 and src.m:
        quantize_into(_local_x2d(src.x, src.m, src.k, plan.local_rows()), plan.recipe,
                      plan.row_q, plan.col_q, src.dtype, prepared.local_out)
    comm._record("all_gather_v", plan.sent_bytes())
    handle = _run(comm, prepared.issue, prepared.post, streams, ptr, async_op, result,
                  (prepared, src.x))
    if sizes is not None and out is not None and src.kind == 0:
        _keep_lane(comm, plan, src, sizes, out, ops, prepared)
    return result, handle


class _Prepared:
    """What a fast gather does with one set of output buffers, built once: the buffers the
    local quantize writes (this rank's slots), the collective's items and its ``issue``, the
    staging buffers and the fix-up (``post``). Reused while the same output buffers come back
    (``out=``) on the same stream: the steady state then builds no views, allocates nothing
    and works out no pointers (each view costs a few microseconds of host time)."""

    __slots__ = ("targets", "stream", "local_out", "items", "issue", "post")

    def matches(self, targets, stream):
        if stream != self.stream:
            return False
        for a, b in zip(targets, self.targets):
            if a is not b:
                return False
        return True

    @classmethod
    def direct(cls, plan, targets, stream):
        """One rank, array input: the local quantize writes the output; the fix-up only
        derives Block2D columnwise (on the current stream, whichever it is)."""
        prepared = cls()
        prepared.targets, prepared.stream, prepared.items, prepared.issue = targets, stream, \
            [], None
        prepared.local_out = [t if q else None for t, q in zip(targets, plan.quantized)]
        prepared.post = _derive_post(plan, targets) if plan.derive_columnwise and plan.M \
            else _nothing
        return prepared


def _prepared(comm, plan, src, targets, ops, stream, reusable):
    cached = plan.prepared
    if cached is not None and src.kind == 0 and cached.matches(targets, stream):
        return cached
    rank = plan.rank
    items, stagings = [], {}
    sends = _block_sends(src, plan) if src.kind == 1 else None
    local_out = [None] * 4
    for part in plan.parts:
        counts, mine, displ = part.counts, part.counts[rank], part.displs[rank]
        if part.mode == SLOT:
            recv = ops.flat_bytes(targets[part.index])[: part.total]
        else:
            recv = stagings[part.index] = ops.empty(part.total, U8)
        if sends is not None:
            items.append((ops.flat_bytes(sends[part.index])[:mine], recv, counts))
            continue
        layout = part.local_layout
        in_place = layout.nbytes == mine and mine and (
            not ops.device or (ops.ptr(recv) + displ) % 16 == 0)
        if in_place:  # quantize straight into this rank's slot of what is gathered
            local = ops.window(recv, displ, layout.shape, part.strides, layout.dtype)
        else:
            local = ops.empty(layout.shape, layout.dtype)
        local_out[part.index] = local
        items.append((None if in_place else ops.flat_bytes(local)[:mine], recv, counts))
    prepared = _Prepared()
    prepared.targets, prepared.stream = list(targets), stream
    prepared.local_out = [b if q else None for b, q in zip(local_out, plan.quantized)]
    prepared.items = items
    prepared.issue = _issuer(comm, items)
    prepared.post = _fix_up_post(plan, targets, stagings, ops, stream)
    # Kept for out= only: without it every call's targets are new, and keeping them would
    # hold the last result's memory. While kept, the plan holds out's buffers and the staging
    # (reusing the staging is as safe as reusing out: device calls are ordered on the stream;
    # a host backend's asynchronous call must be waited for before out is passed again).
    if reusable and src.kind == 0:
        plan.prepared = prepared
    return prepared


# --------------------------------------------------------------------------------------------
# The fix-up: staged parts into place (plan.moves), the scale padding (plan.fills), Block2D
# columnwise derived


def _fix_up_post(plan, targets, stagings, ops, stream):
    """The fix-up of a multi-rank fast gather into ``targets`` as a callable, built once per
    set of buffers. On the device every move and fill is one runtime call enqueued on
    ``stream`` (the communication stream): a cudaMemcpy2DAsync per rank and staged part, a
    cudaMemsetAsync per fill whose bytes are all equal, else a copy from a constant block made
    here. On the host (NumPy, CPU torch) they are copies between strided byte views."""
    derive = _derive_post(plan, targets) if plan.derive_columnwise else None
    if not plan.moves and not plan.fills:
        return derive or _nothing
    if ops.device:
        calls, constants = _device_fix_up_calls(plan, targets, stagings, ops, stream)

        def device_post(keep=constants):  # keep: constant blocks the calls copy from
            for function, args in calls:
                function(*args)
            if derive is not None:
                derive()
        return device_post
    steps = _host_fix_up_steps(plan, targets, stagings, ops)

    def host_post():
        for dst, value in steps:
            if isinstance(value, (int, float)):
                ops.fill(dst, value)
            else:
                ops.copy(dst, value)
        if derive is not None:
            derive()
    return host_post


def _derive_post(plan, targets):
    """Block2D columnwise by FP8 transpose of the gathered rowwise (on the current stream)."""
    derive = backend_for(targets[0]).block2d_columnwise_from_rowwise
    out = (targets[2], targets[3])

    def post():  # returns None: a Handle would take a value for its result
        derive(targets[0], targets[1], out=out)
    return post


def _device_fix_up_calls(plan, targets, stagings, ops, stream):
    """(calls, constants): the runtime calls ``(function, args)`` of the fix-up (see
    :mod:`fp8blk.comm._device_copy`), addresses and sizes worked out once, and the constant
    blocks they copy fills from (filled here on the current stream, which the communication
    stream waits for, in begin(), before the first call reads them)."""
    copies = ops.copies()
    calls, constants = [], []
    for index, dst, dst_pitch, src, src_pitch, width, height in plan.moves:
        calls.append(copies.copy2d(ops.ptr(targets[index]) + dst, dst_pitch,
                                   ops.ptr(stagings[index]) + src, src_pitch, width, height,
                                   stream))
    for index, offset, (height, width), strides, value in plan.fills:
        if not height or not width:
            continue
        dtype = plan.out_layouts[index].dtype
        item = dtype.itemsize
        dst, pitch, row = ops.ptr(targets[index]) + offset, strides[0] * item, width * item
        byte = uniform_byte(value, dtype)
        if byte is not None and (height == 1 or pitch == row):
            calls.append(copies.memset(dst, byte, height * row, stream))
            continue
        constant = ops.empty((height, width), dtype)
        ops.fill(constant, value)
        constants.append(constant)
        calls.append(copies.copy2d(dst, pitch, ops.ptr(constant), row, row, height, stream))
    return calls, constants


def _host_fix_up_steps(plan, targets, stagings, ops):
    """[(destination view, source view or fill value)] of the fix-up on host arrays: each
    move as a (height, width) byte view pair, then the scale padding as typed views."""
    steps = []
    flats = {}

    def flat(index):
        if index not in flats:
            flats[index] = ops.flat_bytes(targets[index])
        return flats[index]
    for index, dst, dst_pitch, src, src_pitch, width, height in plan.moves:
        steps.append((ops.window(flat(index), dst, (height, width), (dst_pitch, 1), U8),
                      ops.window(stagings[index], src, (height, width), (src_pitch, 1), U8)))
    for index, offset, shape, strides, value in plan.fills:
        steps.append((ops.window(flat(index), offset, shape, strides,
                                 plan.out_layouts[index].dtype), value))
    return steps


# --------------------------------------------------------------------------------------------
# The steady state: sizes= and out= given, the same out as before


class _Lane:
    """A fast gather with ``sizes=`` and ``out=`` as the last such call into ``out`` made it:
    what the arguments were, what the input looked like, and the prepared buffers. A call
    that matches all of it (:func:`_steady_lane`) goes straight to the quantize, the
    collective and the fix-up: no Source, no key, no plan lookup, no output checks. Lanes live
    in the plan cache (``PlanCache.lanes``) and go with their plan."""

    __slots__ = ("out", "held", "plan", "cache", "recipe", "rowwise", "columnwise", "sizes",
                 "accepts", "ops", "prepared", "m", "k", "rows", "dtype", "sent")


def _keep_lane(comm, plan, src, sizes, out, ops, prepared):
    lane = _Lane()
    lane.out, lane.held, lane.plan = out, list(internal_buffers(out)), plan
    lane.cache = plan_cache(comm)
    lane.recipe, lane.rowwise, lane.columnwise = src.recipe, src.rowwise, src.columnwise
    lane.sizes = sizes
    lane.accepts = _input_check(src)
    lane.ops, lane.prepared = ops, prepared
    lane.m, lane.k, lane.rows, lane.dtype = src.m, src.k, plan.local_rows(), src.dtype
    lane.sent = plan.sent_bytes()
    lane.cache.keep_lane(plan, lane, out)


def _input_check(src):
    """``accepts(x)``: True when ``x`` is an array like ``src.x`` (same type, dtype, shape,
    device, C-contiguous): then the plan and its checks apply to it unchanged."""
    x, shape, dtype = src.x, tuple(src.x.shape), src.x.dtype
    kind = type(x)
    if kind is np.ndarray:
        return lambda y: (type(y) is kind and y.shape == shape and y.dtype == dtype
                          and y.flags.c_contiguous)
    if src.family == _arrays.TORCH:
        index = x.get_device()
        return lambda y: (type(y) is kind and y.shape == shape and y.dtype is dtype
                          and y.is_contiguous() and y.get_device() == index)
    device = x.device.id
    get_device = _arrays.cupy_module().cuda.runtime.getDevice
    # CuPy allocates and launches on its current device: the lane also needs it to be x's
    return lambda y: (type(y) is kind and y.shape == shape and y.dtype == dtype
                      and y.flags.c_contiguous and y.device.id == device
                      and get_device() == device)


def _steady_lane(comm, x, recipe, rowwise, columnwise, sizes, out, async_op, stream):
    """(lane, streams, ptr) when this call is the steady state of an earlier one, else None."""
    cache = comm._gather_plans
    if cache is None:
        return None
    lane = cache.lanes.get(id(out))
    if lane is None or lane.out is not out:
        return None
    if (rowwise != lane.rowwise or columnwise != lane.columnwise
            or not (recipe is lane.recipe or recipe == lane.recipe)
            or type(sizes) not in (list, tuple) or tuple(sizes) != lane.sizes
            or not lane.accepts(x)):
        return None
    held, seen = internal_buffers(out), lane.held
    if held[0] is not seen[0] or held[1] is not seen[1] or held[2] is not seen[2] \
            or held[3] is not seen[3]:
        return None  # out holds other buffers now: check them
    streams, ptr = _streams_for(comm, lane.ops, stream, async_op)
    if ptr != lane.prepared.stream and not lane.plan.direct:
        return None  # another stream: the fix-up's calls are bound to theirs
    return lane, streams, ptr


def _gather_steady(comm, lane, x, async_op, streams, ptr):
    plan, prepared = lane.plan, lane.prepared
    lane.cache.hits += 1
    comm.stats.record_gather_path(FAST)
    if lane.m:
        quantize_into(_local_x2d(x, lane.m, lane.k, lane.rows), plan.recipe, plan.row_q,
                      plan.col_q, lane.dtype, prepared.local_out)
    comm._record("all_gather_v", lane.sent)
    handle = _run(comm, prepared.issue, prepared.post, streams, ptr, async_op, lane.out, x)
    if async_op:
        return lane.out, handle if handle is not None else Handle.completed(lane.out)
    return lane.out, None


def _fallback(comm, src, plan, out, async_op, stream):
    ops = _internal_ops(src)
    targets = _targets(plan, out, ops)
    result = _result(plan, src, targets, out)
    if src.kind == 1:  # dequantize to the BlockTensor's own dtype, on its backend
        some = next(b for b in src.buffers if b is not None)
        local = backend_for(some).dequantize(src.recipe, (src.m, src.k), *src.buffers,
                                             dtype=src.dtype)
    elif src.family == _arrays.TORCH and not src.device:
        local = _arrays.to_backend(src.x)[0]  # a CPU tensor: its NumPy view (no copy)
    else:
        local = src.x
    streams, ptr = _streams_for(comm, ops, stream, async_op)
    full = ops.empty((plan.M, plan.K), plan.dtype)
    row_bytes = plan.K * plan.dtype.itemsize
    counts = [m * row_bytes for m in plan.ms]
    items = [(ops.flat_bytes(local), ops.flat_bytes(full), counts)]
    comm._record("all_gather_v", counts[plan.rank])

    def post():
        if plan.M:
            quantize_into(full, plan.recipe, plan.rowwise, plan.columnwise, plan.dtype,
                          targets)
    handle = _run(comm, _issuer(comm, items), post, streams, ptr, async_op, result,
                  (items, full))
    return result, handle


def _plain(comm, src, plan, out, async_op, stream):
    ops = ops_for(src.x)  # the caller's family: torch stays torch
    if out is None:
        full = ops.empty(plan.out_shape, src.dtype)
    else:
        full = out
        if _arrays.family_of(out) != src.family or tuple(out.shape) != plan.out_shape:
            raise ValueError(f"out must be a {src.family} array of shape {plan.out_shape}, "
                             f"got {type(out).__name__} of shape {tuple(out.shape)}")
        if _arrays.numpy_dtype(out.dtype) != src.dtype or not _arrays.is_contiguous(out):
            raise ValueError(f"out must be C-contiguous with dtype {src.dtype}")
    streams, ptr = _streams_for(comm, ops, stream, async_op)
    items = [(ops.flat_bytes(src.x), ops.flat_bytes(full), plan.counts)]
    comm._record("all_gather_v", plan.counts[plan.rank])
    return full, _run(comm, _issuer(comm, items), _nothing, streams, ptr, async_op, full,
                      items)


def _nothing():
    return None


def _data_ops(plan, src):
    """The array operations ``plan``'s data moves with for ``src`` (what its path uses)."""
    return _internal_ops(src) if plan.path != PLAIN else ops_for(src.x)


def _join_peers_and_raise(comm, cache, sizes, out, error):
    """This rank's input is invalid, its ``sizes`` well-formed. Peers that hit their cached
    plan for ``sizes`` go straight to its data collectives and would wait forever for this
    rank, so it joins them with zeros and raises ``error``. Their plan, as far as this rank
    can tell without the metadata exchange they skip: ``out``'s steady-state lane, else the
    plan of the last checked call with these sizes (the ranks' caches change alike, so theirs
    hold it too). Neither known (e.g. a first call): return, and the caller probes and
    exchanges, where every rank raises as the peers miss too."""
    lane = cache.lanes.get(id(out)) if out is not None else None
    if lane is not None and lane.out is out and lane.sizes == sizes:
        plan, ops = lane.plan, lane.ops
    else:
        entry = cache.by_sizes.get(sizes)
        if entry is None:
            return
        plan, ops = entry
    _join_with_zeros(comm, plan, ops)
    note = (f"; this rank joined the collectives of its cached plan for sizes={list(sizes)} "
            f"with zeros so that no rank waits forever (the other ranks received zeros for "
            f"its rows and did not raise)")
    raise _with_note(error, note)


def _with_note(error, note):
    """``error`` with ``note`` appended to its message (its type and traceback kept)."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (error.args[0] + note,)
    elif hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note.lstrip("; "))
    return error


def _join_with_zeros(comm, plan, ops):
    """Issue ``plan``'s collectives with zeros as this rank's bytes (so that no peer waits
    forever) on arrays of ``ops``: the sizes= steady state when this rank's input does not fit
    the plan, or is invalid. Every count, item and call is the one the peers issue, as their
    issue depends only on the counts (NCCL's precomputed issuer included)."""
    if plan.path == PLAIN:
        count_sets = [plan.counts]
    elif plan.path == FAST:
        count_sets = [p.counts for p in plan.parts]
    else:
        row_bytes = plan.K * plan.dtype.itemsize
        count_sets = [[m * row_bytes for m in plan.ms]]
    items = []
    for counts in count_sets:
        send = ops.empty(counts[plan.rank], U8)
        ops.fill(send, 0)
        items.append((send, ops.empty(sum(counts), U8), counts))
    comm._record("all_gather_v", plan.sent_bytes())  # the peers count it: so does this rank
    streams, ptr = _streams_for(comm, ops, None, False)
    _run(comm, _issuer(comm, items), _nothing, streams, ptr, False, None)


# --------------------------------------------------------------------------------------------


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
        steady = _steady_lane(comm, x, recipe, rowwise, columnwise, sizes, out, async_op,
                              stream)
        if steady is not None:  # the same call as the last one into out, on new data
            return _gather_steady(comm, steady[0], x, async_op, steady[1], steady[2])
    frame = sys._getframe(1)
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an fp8blk communicator (MPIComm, NCCLComm, "
                        f"TorchComm), got {type(comm).__name__}")
    src, plan, local_error, sizes = _resolve(comm, x, recipe, rowwise, columnwise, sizes,
                                             out)
    comm.stats.record_gather_path(plan.path)
    with _on_device_of(src):
        return _gather(comm, src, plan, local_error, async_op, out, stream, sizes, frame)


def _on_device_of(src):
    """CuPy's current device set to the input's GPU for the call (CuPy allocates and launches
    on its current device, which a torch program's torch.cuda.set_device does not move)."""
    if not src.device:
        return _NULL
    some = src.x if src.kind == 0 else next(b for b in src.buffers if b is not None)
    if _arrays.is_torch(some):
        return _NULL  # torch arrays: torch allocates on the input's device
    import cupy

    device = some.device.id
    if device == cupy.cuda.runtime.getDevice():
        return _NULL
    return cupy.cuda.Device(device)


def _gather(comm, src, plan, local_error, async_op, out, stream, sizes, frame):
    if local_error is not None:
        _join_with_zeros(comm, plan, _data_ops(plan, src))
        raise local_error
    if plan.path == PLAIN:
        result, handle = _plain(comm, src, plan, out, async_op, stream)
    elif plan.path == FAST:
        result, handle = _fast(comm, src, plan, out, async_op, stream, sizes)
    else:
        _warn_once((frame.f_code.co_filename, frame.f_lineno),
                   f"gather_along_first_dim: {plan.reason}; gathering {src.dtype} data and "
                   f"quantizing after the gather (the same bytes, more traffic)")
        result, handle = _fallback(comm, src, plan, out, async_op, stream)
    if async_op:
        return result, handle if handle is not None else Handle.completed(result)
    return result, None


__all__ = ["gather_along_first_dim", "GatherFallbackWarning", "plan_cache", "FAST",
           "FALLBACK", "PLAIN"]
