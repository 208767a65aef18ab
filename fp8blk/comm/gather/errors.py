"""The error protocol of the gather: a rank whose input is invalid, or no longer fits the plan
its peers run from their caches, still joins their data collectives (with zeros and a nonzero
in-band status, :mod:`fp8blk.comm.gather.status`) and then raises, so that no rank waits
forever and every peer raises from the status; the fallback path's warning, once per call
site."""
from __future__ import annotations

import warnings

from .arrays import U8
from .plan import PLAIN
from .status import INPUT_MISMATCH, MALFORMED_SIZES, status_item
from .streams import issuer, nothing, run, streams_for

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

