"""The gather's state of one communicator, kept by the gather (the communicator classes know
nothing of it): its plan cache, in an attribute the gather owns (one attribute read on the
steady state), and the path counters it adds to ``comm.stats`` (``gather_paths``, a Counter of
"fast" / "fallback" / "plain", and ``last_gather_path``)."""
from __future__ import annotations

import collections

from ..base import Stats
from .plan import PlanCache

_STATE = "_fp8blk_gather_plans"

Stats.add_counter("gather_paths", collections.Counter, dict)
Stats.add_counter("last_gather_path", lambda: None)


def cached_plans(comm):
    """``comm``'s plan cache, or None when it has gathered nothing yet."""
    return comm.__dict__.get(_STATE)


def plan_cache(comm) -> PlanCache:
    """The plan cache of ``comm`` (created on first use; tests read ``hits``/``misses``)."""
    cache = comm.__dict__.get(_STATE)
    if cache is None:
        cache = PlanCache()
        setattr(comm, _STATE, cache)
    return cache


def record_path(comm, path):
    """Count a gather that took ``path`` in ``comm.stats``."""
    stats = comm.stats
    stats.gather_paths[path] += 1
    stats.last_gather_path = path


__all__ = ["cached_plans", "plan_cache", "record_path"]
