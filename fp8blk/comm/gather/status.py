"""The gather's state across calls and ranks (docs/distributed.md, "Agreement and errors"): the
communicator's plan cache and path counters, the in-band status every ``sizes=`` collective
carries (how peers learn that one rank raised where no metadata moves) and the fast path's
fix-up (staged parts moved into place, scale padding written), worked out once and replayed."""
from __future__ import annotations

import collections

import numpy as np

from ..._dispatch import backend_for
from ..base import Stats
from .plan import STATUS_BYTES, PlanCache
from .streams import U8, nothing, uniform_byte

Stats.add_counter("gather_paths", collections.Counter, dict)
Stats.add_counter("last_gather_path", lambda: None)


def cached_plans(comm):
    """``comm``'s plan cache, or None when it has gathered nothing yet."""
    return comm.gather_state


def plan_cache(comm) -> PlanCache:
    """The plan cache of ``comm`` (created on first use; tests read ``hits``/``misses``)."""
    cache = comm.gather_state
    if cache is None:
        cache = comm.gather_state = PlanCache()
    return cache


def record_path(comm, path):
    """Count a gather that took ``path`` in ``comm.stats``."""
    stats = comm.stats
    stats.gather_paths[path] += 1
    stats.last_gather_path = path


FINE = 0
MALFORMED_SIZES = 1  # this rank's own sizes= is malformed
INPUT_MISMATCH = 2   # this rank's input is invalid, or does not fit the plan of the sizes
SLOTS = 256  # device records in flight per communicator before the oldest is waited for
_WHAT = {MALFORMED_SIZES: "passed sizes= that are malformed (not one non-negative int per rank)",
         INPUT_MISMATCH: "passed an input that is invalid or does not match these sizes (its "
                         "rows along dim 0, dtype, shape or held directions)"}


def status_item(plan, ops, code=FINE):
    """``(item, recv)``: the status item of a grouped gather of ``plan`` on ``ops``' arrays,
    ``(None, recv, [8] * size)`` (in place), and ``recv``, the flat uint8 buffer of 8 * size
    bytes whose slot of this rank holds ``code`` (little-endian int64)."""
    rank, size = plan.rank, plan.size
    recv = ops.empty(STATUS_BYTES * size, U8)
    ops.fill(recv, 0)
    if code:
        ops.fill(recv[STATUS_BYTES * rank: STATUS_BYTES * rank + 1], code)
    return (None, recv, [STATUS_BYTES] * size), recv


def with_status_item(comm, plan, ops, stream, items, post):
    """``post``, or where ``plan`` carries the status: the status item appended to ``items``
    (last, as every rank appends it) and ``post`` followed by the reading of the codes
    (:func:`with_status`)."""
    if not plan.carries_status:
        return post
    item, recv = status_item(plan, ops)
    items.append(item)
    return with_status(comm, plan, recv, ops, stream, post)


def with_status(comm, plan, recv, ops, stream, post):
    """``post`` (the fix-up) followed by the reading of the gathered codes in ``recv``: on the
    host, a check that raises in this call; on the device, the copy and event of a pending
    record enqueued on ``stream`` (see the module docstring)."""
    if not ops.device:
        codes = ops.host_view(recv).view(np.int64)

        def host_post():
            post()
            if codes.any():
                raise peer_error(plan, codes, earlier=False)
        return host_post
    watch = watch_of(comm, ops)
    address = ops.ptr(recv)

    def device_post():
        post()
        watch.enqueue(address, stream, plan)
    return device_post


class Watch:
    """The pending device statuses of one communicator: per record, the slot of the host buffer
    its codes are copied into (``codes``, (SLOTS, size) int64), the event recorded after the
    copy, and the plan (for the message). Records complete in order on one stream; they are
    looked at oldest first. ``failed``: (plan, codes) of completed records with a nonzero code,
    not raised yet."""

    def __init__(self, copies, size):
        self.copies = copies
        self.row = STATUS_BYTES * size
        self.codes = copies.host_buffer(SLOTS * self.row).view(np.int64).reshape(SLOTS, size)
        self.base = self.codes.ctypes.data
        self.events = [None] * SLOTS
        self.free = list(range(SLOTS - 1, -1, -1))
        self.pending = collections.deque()
        self.failed = []
        self.fresh = False  # the newest record is the current call's (not looked at yet)

    def enqueue(self, address, stream, plan):
        """After the collective on ``stream``: copy its codes (device ``address``) to a slot,
        record the slot's event. With every slot in flight the oldest is waited for first."""
        if not self.free:
            self.poll(block_one=True)
        slot = self.free.pop()
        event = self.events[slot]
        if event is None:
            event = self.events[slot] = self.copies.new_event()
        self.copies.to_host(self.base + slot * self.row, address, self.row, stream)
        self.copies.record(event, stream)
        self.pending.append((slot, plan))
        self.fresh = True

    def poll(self, block=False, block_one=False, keep_newest=False):
        """Move completed records out of ``pending`` (into ``failed`` when a code is
        nonzero); ``block``: wait for all of them; ``block_one``: for the oldest;
        ``keep_newest``: leave the newest record pending."""
        pending, copies = self.pending, self.copies
        keep = 1 if keep_newest else 0
        while len(pending) > keep:
            slot, plan = pending[0]
            event = self.events[slot]
            if block or block_one:
                copies.synchronize(event)
                block_one = False
            elif not copies.done(event):
                return
            pending.popleft()
            codes = self.codes[slot]
            if codes.any():
                self.failed.append((plan, codes.copy()))
            self.free.append(slot)

    def check(self):
        """Raise the first failed record's error (without blocking), of the records before
        the current call's: a synchronous call learns of its own gather's status at the next
        call, whenever the device completes it. Returns None (a Handle's post)."""
        if self.pending:
            self.poll(keep_newest=self.fresh)
        self.fresh = False
        if self.failed:
            plan, codes = self.failed[0]
            more = len(self.failed) - 1
            self.failed.clear()
            raise peer_error(plan, codes, earlier=True, more=more)


def watch_of(comm, ops):
    """The :class:`Watch` of ``comm``'s gather state (made on first use, with ``ops``' runtime
    calls)."""
    cache = plan_cache(comm)
    watch = cache.watch
    if watch is None:
        watch = cache.watch = Watch(ops.copies(), comm.size)
    return watch


def peer_error(plan, codes, earlier, more=0):
    """The ValueError of a peer of the rank(s) whose nonzero codes ``codes`` holds."""
    bad = [(r, int(c)) for r, c in enumerate(codes) if c]
    what = "; ".join(f"rank {r} {_WHAT.get(c, f'raised (status {c})')}" for r, c in bad)
    ranks = [r for r, _ in bad]
    where = ("a gather_along_first_dim issued earlier on this communicator" if earlier
             else "gather_along_first_dim")
    message = (f"{where} (sizes={plan.dim0s}): {what}; it joined the collectives with zeros "
               f"and raised there, so the rows gathered from rank(s) {ranks} are zeros: pass "
               f"the same sizes on every rank, and inputs that match them")
    if earlier:
        message += ("; the gather of this call (if any) was issued as usual" +
                    (f" ({more} more such gather(s) since)" if more else ""))
    return ValueError(message)


def settle(cache, out, handle):
    """``(out, handle)`` of a gather call, after the device statuses that completed were looked
    at: a synchronous call raises here (its own collectives are issued: no rank is left
    waiting), an asynchronous call's handle raises in ``wait()``. No device use: as given."""
    watch = None if cache is None else cache.watch
    if watch is None:
        return out, handle
    if handle is not None:
        watch.fresh = False  # wait() looks at every completed record, its own included
        return out, handle.then(watch.check)
    watch.check()
    return out, None


def check_pending(comm):
    """Wait for the device gathers with ``sizes=`` issued on ``comm`` so far (blocking on their
    events) and raise the ValueError of any that a rank joined with zeros (a peer of a rank
    that raised). Host arrays raise in the call itself; there this returns at once."""
    cache = cached_plans(comm)
    watch = None if cache is None else cache.watch
    if watch is None:
        return
    watch.poll(block=True)
    watch.check()


def fix_up_post(plan, targets, stagings, ops, stream):
    """The fix-up of a multi-rank fast gather into ``targets`` as a callable, built once per
    set of buffers. On the device every move and fill is one runtime call enqueued on
    ``stream`` (the communication stream): a cudaMemcpy2DAsync per rank and staged part, a
    cudaMemsetAsync per fill whose bytes are all equal, else a copy from a constant block made
    here. On the host (NumPy, CPU torch) they are copies between strided byte views."""
    derive = derive_post(plan, targets) if plan.derive_columnwise else None
    if not plan.moves and not plan.fills:
        return derive or nothing
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


def derive_post(plan, targets):
    """Block2D columnwise by FP8 transpose of the gathered rowwise (on the current stream)."""
    derive = backend_for(targets[0]).block2d_columnwise_from_rowwise
    out = (targets[2], targets[3])

    def post():  # returns None: a Handle would take a value for its result
        derive(targets[0], targets[1], out=out)
    return post


def _device_fix_up_calls(plan, targets, stagings, ops, stream):
    """(calls, constants): the runtime calls ``(function, args)`` of the fix-up (see
    :mod:`fp8blk.comm.gather.streams`), addresses and sizes worked out once, and the constant
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
