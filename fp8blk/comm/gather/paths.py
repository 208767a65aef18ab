"""The three paths of the gather (docs/distributed.md, "Quantized all-gather"): ``fast``,
``fallback`` and ``plain`` with the output buffers they write; the steady-state lane of
``sizes=`` with ``out=``; the error protocol (a rank that cannot take its peers' plan joins
their collectives with zeros, then raises) and the fallback's warning."""
from __future__ import annotations

import warnings

import numpy as np

from ... import _arrays
from ..._dispatch import backend_for
from ...formats import Block2D
from ...ops import quantize_into
from ...tensor import BlockTensor, from_internal, internal_buffers
from ..base import Handle
from .plan import COL, FAST, PLAIN, ROW, SLOT
from .status import (INPUT_MISMATCH, MALFORMED_SIZES, cached_plans, derive_post, fix_up_post,
                     plan_cache, record_path, settle, status_item, with_status_item)
from .streams import U8, internal_ops, issuer, local_x2d, nothing, ops_for, run, streams_for

#: when the peers of a rank that joined with zeros raise (the end of their messages)
PEERS_RAISE = ("host arrays in this call, device arrays at their next gather on this "
               "communicator, in wait() or in fp8blk.comm.gather.check_pending")


class GatherFallbackWarning(UserWarning):
    """gather_along_first_dim gathered high-precision data because the FP8 shards could not
    be gathered as they are (same result, more traffic)."""
warned_sites = set()


def warn_once(site, message):
    if site in warned_sites:
        return
    warned_sites.add(site)
    warnings.warn_explicit(message, GatherFallbackWarning, site[0], site[1])


def join_peers_and_raise(comm, cache, sizes, src, out, error):
    """This rank's input or its ``sizes`` is invalid. Peers that hit their cached plan for
    their ``sizes`` go straight to its data collectives and would wait forever for this
    rank, so it joins them with zeros and raises ``error``. Their plan, as far as this rank
    can tell without the metadata exchange they skip: ``out``'s steady-state lane, else the
    latest checked ``sizes=`` call with these ``sizes`` (well-formed ``sizes``) or, when
    this rank's ``sizes`` is malformed, the latest one whose plan gathers what ``src`` is
    (the ranks' caches change alike, so theirs hold it too). Its status code tells the peers
    which (malformed ``sizes``, or an input that does not fit). Neither known (e.g. a first
    call): return, and the caller probes and exchanges, where every rank raises as the
    peers miss too."""
    lane = cache.lanes.get(id(out)) if out is not None else None
    if lane is not None and lane.out is out and (sizes is None or lane.sizes == sizes):
        plan, ops = lane.plan, lane.ops
    else:
        if sizes is not None:
            entry = cache.last_sizes_call(lambda plan: tuple(plan.dim0s) == sizes)
        elif src is not None:
            entry = cache.last_sizes_call(lambda plan: plan.serves(src))
        else:
            entry = None
        if entry is None:
            return
        plan, ops = entry
    join_with_zeros(comm, plan, ops, MALFORMED_SIZES if sizes is None else INPUT_MISMATCH)
    which = (f"its cached plan for sizes={list(sizes)}" if sizes is not None else
             f"the latest gather with sizes= of its input (sizes={plan.dim0s})")
    note = (f"; this rank joined the collectives of {which} with zeros so that no rank waits "
            f"forever (the other ranks received zeros for its rows and raise too, "
            f"{PEERS_RAISE})")
    raise _with_note(error, note)


def _with_note(error, note):
    """``error`` with ``note`` appended to its message (its type and traceback kept)."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (error.args[0] + note,)
    elif hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note.lstrip("; "))
    return error


def join_with_zeros(comm, plan, ops, code=INPUT_MISMATCH):
    """Issue ``plan``'s collectives with zeros as this rank's bytes (so that no peer waits
    forever) and ``code`` as its in-band status (so that every peer raises) on arrays of
    ``ops``: the sizes= steady state when this rank's input does not fit the plan, or is
    invalid, or its ``sizes`` is malformed. Every count, item and call is the one the peers
    issue, as their issue depends only on the counts (NCCL's precomputed issuer included)."""
    if plan.path == PLAIN:
        count_sets = [plan.counts]
    else:  # the parts gathered as they are; the fallback's high-precision part last
        count_sets = [p.counts for p in plan.parts]
        if plan.hp_gather:
            count_sets.append(plan.hp_counts())
    items = []
    for counts in count_sets:
        send = ops.empty(counts[plan.rank], U8)
        ops.fill(send, 0)
        items.append((send, ops.empty(sum(counts), U8), counts))
    if plan.carries_status:  # last, as the peers' paths append it
        items.append(status_item(plan, ops, code)[0])
    comm.record("all_gather_v", plan.sent_bytes())  # the peers count it: so does this rank
    streams, ptr = streams_for(comm, ops, None, False)
    run(comm, issuer(comm, items), nothing, streams, ptr, False, None)


class _Lane:
    """A fast gather with ``sizes=`` and ``out=`` as the last such call into ``out`` made it:
    what the arguments were, what the input looked like, and the prepared buffers. A call
    that matches all of it (:func:`steady_lane`) goes straight to the quantize, the
    collective and the fix-up: no Source, no key, no plan lookup, no output checks. Lanes live
    in the plan cache (``PlanCache.lanes``) and go with their plan."""

    __slots__ = ("out", "held", "plan", "cache", "recipe", "rowwise", "columnwise", "sizes",
                 "accepts", "ops", "prepared", "m", "k", "rows", "dtype", "sent")


def keep_lane(comm, plan, src, sizes, out, ops, prepared):
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


def steady_lane(comm, x, recipe, rowwise, columnwise, sizes, out, async_op, stream):
    """(lane, streams, ptr) when this call is the steady state of an earlier one, else None."""
    cache = cached_plans(comm)
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
    streams, ptr = streams_for(comm, lane.ops, stream, async_op)
    if ptr != lane.prepared.stream and not lane.plan.direct:
        return None  # another stream: the fix-up's calls are bound to theirs
    return lane, streams, ptr


def gather_steady(comm, lane, x, async_op, streams, ptr):
    plan, prepared = lane.plan, lane.prepared
    lane.cache.hits += 1
    record_path(comm, FAST)
    if lane.m:
        quantize_into(local_x2d(x, lane.m, lane.k, lane.rows), plan.recipe, plan.row_q,
                      plan.col_q, lane.dtype, prepared.local_out)
    comm.record("all_gather_v", lane.sent)
    handle = run(comm, prepared.issue, prepared.post, streams, ptr, async_op, lane.out, x)
    if async_op and handle is None:
        handle = Handle.completed(lane.out)
    return settle(lane.cache, lane.out, handle)


def result_ops(src):
    """Operations on the internal arrays the result holds: NumPy on the host, CuPy for CuPy
    input, torch for torch CUDA input (the kernels run on torch tensors natively, on torch's
    current stream, so nothing crosses DLPack)."""
    if not src.device:
        return internal_ops(False)
    some = src.x if not src.is_block else next(b for b in src.buffers if b is not None)
    if _arrays.is_torch(some):
        return ops_for(some)
    return internal_ops(True)


def targets_for(plan, out, ops):
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
        if ops_for(buf).name != ops.name:
            raise ValueError("out is on another device (or array family) than the input")
        if (tuple(buf.shape) != layouts[i].shape or ops.dtype(buf) != layouts[i].dtype
                or not ops.contiguous(buf) or (ops.device and ops.ptr(buf) % 16)):
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


def _block_sends(src, plan):
    """The BlockTensor input's buffers (Block2D rowwise derived when it holds columnwise)."""
    buffers = list(src.buffers)
    if isinstance(plan.recipe, Block2D) and buffers[0] is None:
        backend = backend_for(buffers[2])
        buffers[0], buffers[1] = backend.block2d_columnwise_from_rowwise(
            buffers[2], buffers[3], out=(None, None))
    return buffers


def gather_fast(comm, src, plan, out, async_op, stream, sizes):
    ops = result_ops(src)
    targets = targets_for(plan, out, ops)
    result = _result(plan, src, targets, out)
    streams, ptr = streams_for(comm, ops, stream, async_op)
    if plan.direct:  # one rank: the output IS the local quantize
        prepared = _Prepared.direct(plan, targets, ptr)
    else:
        prepared = _prepared(comm, plan, src, targets, ops, ptr, out is not None)
    if not src.is_block and src.m:
        quantize_into(local_x2d(src.x, src.m, src.k, plan.local_rows()), plan.recipe,
                      plan.row_q, plan.col_q, src.dtype, prepared.local_out)
    comm.record("all_gather_v", plan.sent_bytes())
    handle = run(comm, prepared.issue, prepared.post, streams, ptr, async_op, result,
                  (prepared, src.x))
    if sizes is not None and out is not None and not src.is_block:
        keep_lane(comm, plan, src, sizes, out, ops, prepared)
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
        prepared.post = derive_post(plan, targets) if plan.derive_columnwise and plan.M \
            else nothing
        return prepared


def _prepared(comm, plan, src, targets, ops, stream, reusable):
    cached = plan.prepared
    if cached is not None and not src.is_block and cached.matches(targets, stream):
        return cached
    rank = plan.rank
    items, stagings = [], {}
    sends = _block_sends(src, plan) if src.is_block else None
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
    post = fix_up_post(plan, targets, stagings, ops, stream)
    # the status item is kept with the prepared items: the steady state makes none
    post = with_status_item(comm, plan, ops, stream, items, post)
    prepared = _Prepared()
    prepared.targets, prepared.stream = list(targets), stream
    prepared.local_out = [b if q else None for b, q in zip(local_out, plan.quantized)]
    prepared.items = items
    prepared.issue = issuer(comm, items)
    prepared.post = post
    # Kept for out= only: without it every call's targets are new, and keeping them would
    # hold the last result's memory. While kept, the plan holds out's buffers and the staging
    # (reusing the staging is as safe as reusing out: device calls are ordered on the stream;
    # a host backend's asynchronous call must be waited for before out is passed again).
    if reusable and not src.is_block:
        plan.prepared = prepared
    return prepared


def gather_fallback(comm, src, plan, out, async_op, stream):
    """Directions every rank's BlockTensor holds, and can send as they are, move as their
    bytes (the kept bytes stay what the ranks hold); the other asked directions are derived
    after the gather: quantized from the dequantize of a kept direction, or with none kept,
    from the high-precision data gathered (a BlockTensor dequantized per rank first)."""
    ops = result_ops(src)
    targets = targets_for(plan, out, ops)
    result = _result(plan, src, targets, out)
    streams, ptr = streams_for(comm, ops, stream, async_op)
    items, stagings = [], {}
    for part in plan.parts:  # the kept directions: the BlockTensor's own bytes
        if part.mode == SLOT:
            recv = ops.flat_bytes(targets[part.index])[: part.total]
        else:
            recv = stagings[part.index] = ops.empty(part.total, U8)
        items.append((ops.flat_bytes(src.buffers[part.index])[: part.counts[plan.rank]], recv,
                      part.counts))
    fix_up = fix_up_post(plan, targets, stagings, ops, ptr) if plan.parts else nothing
    full = None
    if plan.hp_gather:
        local = _high_precision(src, plan)
        full = ops.empty((plan.M, plan.K), plan.dtype)
        items.append((ops.flat_bytes(local), ops.flat_bytes(full), plan.hp_counts()))
    comm.record("all_gather_v", plan.sent_bytes())
    derived = [targets[i] if _derives(plan, i) else None for i in range(4)]
    kept = [targets[i] if not _derives(plan, i) else None for i in range(4)]

    def post():
        fix_up()
        if plan.M and plan.derived:
            values = full
            if values is None:  # concatenated values of the kept direction, exactly
                values = backend_for(targets[plan.targets[0]]).dequantize(
                    plan.recipe, (plan.M, plan.K), *kept, dtype=plan.dtype)
            quantize_into(values, plan.recipe, ROW in plan.derived, COL in plan.derived,
                          plan.dtype, derived)
    post = with_status_item(comm, plan, ops, ptr, items, post)
    handle = run(comm, issuer(comm, items), post, streams, ptr, async_op, result,
                  (items, full, stagings))
    return result, handle


def _derives(plan, index):
    """Whether output buffer ``index`` (rowwise 0, 1; columnwise 2, 3) is derived."""
    return (ROW if index < 2 else COL) in plan.derived


def _high_precision(src, plan):
    """This rank's values for the fallback's high-precision gather: an array input as it is;
    a BlockTensor dequantized (to its own dtype, on its backend) from ``plan.hp_source``."""
    if src.is_block:
        buffers = list(src.buffers)
        if plan.hp_source == ROW:
            buffers[2] = buffers[3] = None
        elif plan.hp_source == COL:
            buffers[0] = buffers[1] = None
        some = next(b for b in buffers if b is not None)
        return backend_for(some).dequantize(src.recipe, (src.m, src.k), *buffers,
                                            dtype=src.dtype)
    if src.family == _arrays.TORCH and not src.device:
        return _arrays.to_backend(src.x)[0]  # a CPU tensor: its NumPy view (no copy)
    return src.x


def gather_plain(comm, src, plan, out, async_op, stream):
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
    streams, ptr = streams_for(comm, ops, stream, async_op)
    items = [(ops.flat_bytes(src.x), ops.flat_bytes(full), plan.counts)]
    post = with_status_item(comm, plan, ops, ptr, items, nothing)
    comm.record("all_gather_v", plan.sent_bytes())
    return full, run(comm, issuer(comm, items), post, streams, ptr, async_op, full,
                      items)


def data_ops(plan, src):
    """The array operations ``plan``'s data moves with for ``src`` (what its path uses)."""
    return result_ops(src) if plan.path != PLAIN else ops_for(src.x)
