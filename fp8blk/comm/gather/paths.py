"""The three paths of the gather (module docstring of :mod:`fp8blk.comm.gather`): ``fast``
(each rank quantizes into its slot of the output, one grouped collective, the fix-up),
``fallback`` (high-precision data gathered, quantized after) and ``plain`` (no recipe), with
the output buffers they write."""
from __future__ import annotations

import numpy as np

from ... import _arrays
from ..._dispatch import backend_for
from ...formats import Block2D
from ...ops import quantize_into
from ...tensor import BlockTensor, from_internal, internal_buffers
from .arrays import U8, internal_ops, local_x2d, ops_for
from .fixup import derive_post, fix_up_post
from .lane import keep_lane
from .plan import COL, PLAIN, ROW, SLOT
from .status import with_status_item
from .streams import issuer, nothing, run, streams_for


def result_ops(src):
    """Operations on the internal arrays the result holds: NumPy on the host, CuPy for CuPy
    input, torch for torch CUDA input (the kernels run on torch tensors natively, on torch's
    current stream, so nothing crosses DLPack)."""
    if not src.device:
        return internal_ops(False)
    some = src.x if src.kind == 0 else next(b for b in src.buffers if b is not None)
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
    if src.kind == 0 and src.m:
        quantize_into(local_x2d(src.x, src.m, src.k, plan.local_rows()), plan.recipe,
                      plan.row_q, plan.col_q, src.dtype, prepared.local_out)
    comm.record("all_gather_v", plan.sent_bytes())
    handle = run(comm, prepared.issue, prepared.post, streams, ptr, async_op, result,
                  (prepared, src.x))
    if sizes is not None and out is not None and src.kind == 0:
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
    if reusable and src.kind == 0:
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
    if src.kind == 1:
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

