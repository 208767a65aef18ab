"""The in-band status of a ``sizes=`` gather: how every rank learns that one rank raised in the
steady state, where no metadata moves.

Every data collective of a plan made with ``sizes=`` on more than one rank carries one more
item in its grouped collective: 8 bytes per rank, an int64 code gathered in place into a
buffer of 8 * size bytes (rank r's code at byte 8 * r). A rank that joins its peers'
collectives with zeros (:func:`fp8blk.comm.gather.errors.join_with_zeros`) sends its nonzero
code (:data:`MALFORMED_SIZES`, :data:`INPUT_MISMATCH`); every other call sends 0 (its slot of
the status buffer is zeroed when the buffer is made, and only the collective writes it after,
with that same 0). Every rank appends the item last, with the same counts, so the items, their
counts and the order of the calls are the same everywhere (NCCL's issuer is worked out from the
counts once; the steady-state lane keeps the buffer with its prepared items, so the steady state
allocates nothing for it). The 8 bytes are counted in ``comm.stats`` with the data
(``Plan.sent_bytes``).

Reading the gathered codes:

* Host arrays (MPI, gloo, the NumPy fake world): after the collective, in the same call (an
  asynchronous call: in its ``Handle.wait()``), a nonzero code raises ValueError naming the
  rank(s), on every peer.
* Device arrays (CuPy, torch CUDA): reading them at once would be a host synchronization per
  call. Instead a copy of the gathered codes into a slot of a host buffer and an event are
  enqueued on the collective's stream after it, and kept as pending (:class:`Watch`, one per
  communicator). Completed records are looked at without blocking (``event`` queries) at the end
  of every later gather call on the communicator, after that call has issued its collectives
  (a peer that raised before issuing them would leave the ranks that have not seen the status
  yet waiting in them), and in ``Handle.wait()`` of an asynchronous one; a nonzero code raises
  there. :func:`check_pending` blocks on every pending event and raises at once.
"""
from __future__ import annotations

import collections

import numpy as np

from .arrays import U8
from .plan import STATUS_BYTES
from .state import cached_plans, plan_cache

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


__all__ = ["status_item", "with_status_item", "with_status", "Watch", "watch_of", "peer_error", "settle",
           "check_pending", "FINE", "MALFORMED_SIZES", "INPUT_MISMATCH", "STATUS_BYTES"]
