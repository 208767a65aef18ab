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
                uint8). One small step then puts what the layout interleaves in place (the
                Block1D rowwise scales (cdiv(K,128), round4(M)) whose columns are the ranks'
                rows; Block1D columnwise data (K, M)) and writes the scale padding (1.0 fp32,
                0 E8M0): one strided copy per buffer for equal shards. Block2D gathers rowwise
                only and derives columnwise by FP8 transpose. A BlockTensor input sends its own
                bytes.
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
exchanges anything.

Streams (device arrays): the local quantize runs on the current stream; the collective and the
fix-up step run on ``stream`` (default: the current stream), which first waits for the current
stream. A synchronous call returns once everything is enqueued (the current stream then waits
for ``stream``); with ``async_op=True`` the returned Handle's ``wait()`` makes the then-current
stream wait for an event: no host synchronization, no Python callbacks. Host backends (MPI,
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
from ..layout import cdiv, round_up
from ..tensor import BlockTensor, internal_buffers
from ._gather_plan import (FALLBACK, FAST, PLAIN, SLOT, STAGED, Plan, PlanCache, Source,
                           check_sizes, exchange, local_key)
from ._native import U8, contiguous, internal_ops, logical_dtype, ops_for, quantize_into
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


def _resolve(comm, x, recipe, rowwise, columnwise, sizes):
    """(source, plan, local_error): ``local_error`` is set only on the ``sizes=`` steady
    state when this rank's input does not fit the plan its peers use."""
    src = error = None
    try:
        src = Source(x, recipe, rowwise, columnwise)
        if sizes is not None:
            sizes = check_sizes(sizes, comm.size)
    except Exception as caught:  # every rank must learn of it, or its peers would wait
        error = caught
    cache = plan_cache(comm)
    key = None if error is not None else local_key(src, sizes)
    plan = None if key is None else cache.get(key)
    if comm.size == 1:
        if error is not None:
            raise error
    elif sizes is not None and plan is not None:
        problem = plan.expects(src)
        cache.hits += 1
        return src, plan, (None if problem is None else ValueError(
            f"gather_along_first_dim: {problem}; this rank joined the collectives with zeros "
            f"so that no rank waits forever (the other ranks received zeros for its rows): "
            f"pass the true sizes"))
    else:
        # The check: MAX of [h, -h] is [h, -h] only when every rank found the same plan. A
        # miss with sizes= makes it too (then exchanges), so that a miss issues the same two
        # host collectives whether or not the ranks passed sizes=.
        mark = plan.table_hash if plan is not None else -1 - comm.rank
        probe = comm._meta_all_reduce_max(np.array([mark, -mark], dtype=np.int64))
        if plan is not None and probe[0] == -probe[1]:
            cache.hits += 1
            return src, plan, None
        plan = None
    if plan is not None:  # world size 1
        cache.hits += 1
        return src, plan, None
    cache.misses += 1
    columns, table_hash = exchange(comm, src, sizes, error)
    plan = Plan(src, columns, comm.size, comm.rank, table_hash)
    cache.put(key, plan)
    return src, plan, None


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
                self.ptr = _torch_current_stream_ptr(torch)
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


def _torch_current_stream_ptr(torch):
    """The raw pointer of torch's current CUDA stream (without building a Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(torch.cuda.current_device())
    return torch.cuda.current_stream().cuda_stream


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


def _run(comm, items, post, ops, streams, async_op, result):
    """Issue the grouped gather of ``items``, then ``post()`` (the fix-up). Returns the
    Handle (async) or None."""
    stream_ordered = streams is not None and comm._stream_ordered
    if streams is None:  # host arrays
        finish = comm._gather_parts(items) if items else None
        if async_op:
            return Handle(waiter=finish, post=post, result=result)
        if finish is not None:
            finish()
        post()
        return None
    streams.begin()
    with streams.context():
        if items:
            with streams.torch_context() if comm._orders_torch_stream else _NULL:
                finish = comm._gather_parts(items, streams.ptr)
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
        return Handle(waiter=complete, result=result)
    waiter = streams.end(async_op)
    return Handle(waiter=waiter, result=result) if async_op else None


def _streams_for(ops, stream):
    """The streams of a device gather, in the flavour of its arrays (None on the host)."""
    if not ops.device:
        return None
    return _DeviceStreams(ops.family == _arrays.TORCH, stream)


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
    return BlockTensor._wrap(plan.out_shape, plan.recipe, final, src.dtype, src.family)


# --------------------------------------------------------------------------------------------
# Paths


def _local_x2d(src, plan, ops):
    """The local (M_local, K) high-precision array as the quantize backend takes it."""
    x = src.x
    rows = plan.local_rows()
    if src.family == _arrays.TORCH and not x.is_cuda:
        x = _arrays.to_backend(x)[0]  # NumPy-backed, no copy
    x2d = x.reshape(src.m, src.k)
    if rows != src.m:  # MXFP8 rowwise: zero rows up to a multiple of 32 (never sent)
        if ops_for(x2d).family == _arrays.TORCH:
            padded = x2d.new_zeros((rows, src.k))
        else:
            padded = (np if isinstance(x2d, np.ndarray) else _arrays._cupy()).zeros(
                (rows, src.k), dtype=x2d.dtype)
        padded[: src.m] = x2d
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


def _fast(comm, src, plan, out, async_op, stream):
    ops = _internal_ops(src)
    targets = _targets(plan, out, ops)
    result = _result(plan, src, targets, out)
    # one rank, synchronous, current stream: everything is plain stream-ordered launches
    quiet = plan.direct and stream is None and not async_op
    streams = None if quiet else _streams_for(ops, stream)
    quantized = plan.quantized
    if plan.direct:  # one rank: the output IS the local quantize
        if src.m:
            quantize_into(_local_x2d(src, plan, ops), plan.recipe, plan.row_q, plan.col_q,
                          src.dtype, [t if q else None for t, q in zip(targets, quantized)])
        items = []
        post = _nothing if not plan.needs_fix_up else (
            lambda: _fix_up(plan, targets, {}, ops, True))
    else:
        prepared = _prepared(plan, src, targets, ops, streams, out is not None)
        items = prepared.items
        if src.kind == 0 and src.m:
            quantize_into(_local_x2d(src, plan, ops), plan.recipe, plan.row_q, plan.col_q,
                          src.dtype, prepared.local_out)
        post = prepared.post
    comm._record("all_gather_v", plan.sent_bytes())
    handle = _run(comm, items, post, ops, streams, async_op, result)
    return result, handle


class _Prepared:
    """What a multi-rank fast gather does with one set of output buffers, built once: the
    windows the local quantize writes (this rank's slots), the collective's items, the
    staging buffers and the fix-up's views. Reused while the same output buffers come back
    (``out=``) on the same stream: the steady state then builds no views and allocates
    nothing (each view costs a few microseconds of host time)."""


    __slots__ = ("targets", "stream", "local_out", "items", "post")

    def matches(self, targets, stream):
        if stream != self.stream:
            return False
        for a, b in zip(targets, self.targets):
            if a is not b:
                return False
        return True


def _prepared(plan, src, targets, ops, streams, reusable):
    stream = None if streams is None else streams.ptr
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
    if plan.needs_fix_up:
        steps = _fix_up_steps(plan, targets, stagings, ops)
        prepared.post = lambda: _apply_fix_up(plan, targets, steps, ops)
    else:
        prepared.post = _nothing
    # Kept for out= only: without it every call's targets are new, and keeping them would
    # hold the last result's memory. While kept, the plan holds out's buffers and the staging
    # (reusing the staging is as safe as reusing out: device calls are ordered on the stream;
    # a host backend's asynchronous call must be waited for before out is passed again).
    if reusable and src.kind == 0:
        plan.prepared = prepared
    return prepared


def _fix_up(plan, targets, stagings, ops, direct):
    """Put the staged parts in place, write the scale padding, derive Block2D columnwise
    (``direct``: the local quantize wrote the whole output; only the derivation is left)."""
    if direct:
        if plan.derive_columnwise and plan.M:
            _apply_fix_up(plan, targets, (), ops)
        return
    _apply_fix_up(plan, targets, _fix_up_steps(plan, targets, stagings, ops), ops)


def _apply_fix_up(plan, targets, steps, ops):
    """Run `steps` (see _fix_up_steps), then derive Block2D columnwise by FP8 transpose."""
    for dst, value in steps:
        if isinstance(value, (int, float)):
            ops.fill(dst, value)
        else:
            ops.copy(dst, value)
    if plan.derive_columnwise:
        backend_for(targets[0]).block2d_columnwise_from_rowwise(
            targets[0], targets[1], out=(targets[2], targets[3]))


def _fix_up_steps(plan, targets, stagings, ops):
    """[(destination view, source view or fill value)]: the staged parts moved into place
    (the Block1D rowwise scales (cdiv(K,128), round4(M)) whose columns are the ranks' rows;
    Block1D columnwise data (K, M)), then the scale padding."""
    ms, offsets, K, M, size = plan.ms, plan.offsets, plan.K, plan.M, plan.size
    equal = size > 1 and all(m == ms[0] for m in ms) and ms[0] > 0
    steps = []
    for part in plan.parts:
        if part.mode != STAGED:
            continue
        staging, flat = stagings[part.index], ops.flat_bytes(targets[part.index])
        if part.index == 1:  # Block1D rowwise scales: rank r's rows are columns [o, o+m)
            kb, width, dtype = cdiv(K, 128), round_up(M, 4), np.float32
            if equal:
                m, w = ms[0], round_up(ms[0], 4)
                steps.append((ops.window(flat, 0, (kb, size, m), (width, m, 1), dtype),
                              ops.window(staging, 0, (kb, size, m), (w, kb * w, 1), dtype)))
                continue
            for r, (m, o) in enumerate(zip(ms, offsets)):
                if m:
                    steps.append((ops.window(flat, o * 4, (kb, m), (width, 1), dtype),
                                  ops.window(staging, part.displs[r], (kb, m),
                                             (round_up(m, 4), 1), dtype)))
        else:  # Block1D columnwise data (K, M): rank r's (K, m) is columns [o, o+m)
            if equal:
                m = ms[0]
                steps.append((ops.window(flat, 0, (K, size, m), (M, m, 1), U8),
                              ops.window(staging, 0, (K, size, m), (m, K * m, 1), U8)))
                continue
            for r, (m, o) in enumerate(zip(ms, offsets)):
                if m:
                    steps.append((ops.window(flat, o, (K, m), (M, 1), U8),
                                  ops.window(staging, part.displs[r], (K, m), (m, 1), U8)))
    for index, offset, shape, strides, value in plan.fills:
        target = targets[index]
        steps.append((ops.window(ops.flat_bytes(target), offset, shape, strides,
                                 target.dtype), value))
    return steps


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
    streams = _streams_for(ops, stream)
    full = ops.empty((plan.M, plan.K), plan.dtype)
    row_bytes = plan.K * plan.dtype.itemsize
    counts = [m * row_bytes for m in plan.ms]
    items = [(ops.flat_bytes(local), ops.flat_bytes(full), counts)]
    comm._record("all_gather_v", counts[plan.rank])

    def post():
        if plan.M:
            quantize_into(full, plan.recipe, plan.rowwise, plan.columnwise, plan.dtype,
                          targets)
    handle = _run(comm, items, post, ops, streams, async_op, result)
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
    streams = _streams_for(ops, stream)
    items = [(ops.flat_bytes(src.x), ops.flat_bytes(full), plan.counts)]
    comm._record("all_gather_v", plan.counts[plan.rank])
    return full, _run(comm, items, _nothing, ops, streams, async_op, full)


def _nothing():
    return None


def _join_with_zeros(comm, plan, src):
    """The ``sizes=`` steady state when this rank's input does not fit the plan: issue the
    plan's collectives with zeros (so that no peer waits forever), then raise."""
    ops = _internal_ops(src) if plan.path != PLAIN else ops_for(src.x)
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
    _run(comm, items, _nothing, ops, _streams_for(ops, None), False, None)


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
    frame = sys._getframe(1)
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an fp8blk communicator (MPIComm, NCCLComm, "
                        f"TorchComm), got {type(comm).__name__}")
    src, plan, local_error = _resolve(comm, x, recipe, rowwise, columnwise, sizes)
    comm.stats.record_gather_path(plan.path)
    with _on_device_of(src):
        return _gather(comm, src, plan, local_error, async_op, out, stream, frame)


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


def _gather(comm, src, plan, local_error, async_op, out, stream, frame):
    if local_error is not None:
        _join_with_zeros(comm, plan, src)
        raise local_error
    if plan.path == PLAIN:
        result, handle = _plain(comm, src, plan, out, async_op, stream)
    elif plan.path == FAST:
        result, handle = _fast(comm, src, plan, out, async_op, stream)
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
