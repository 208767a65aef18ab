"""Which plan a gather call runs (the cache protocol of :mod:`fp8blk.comm.gather.plan`): this
rank's input checked, the communicator's plan cache consulted, then the probe that every rank
found the same plan (:mod:`fp8blk.comm.agree`) or the metadata exchange that makes a new one."""
from __future__ import annotations

from ..agree import all_agree
from .errors import PEERS_RAISE, join_peers_and_raise
from .paths import data_ops
from .plan import Plan, Source, check_sizes, exchange, local_key
from .state import plan_cache


def resolve(comm, x, recipe, rowwise, columnwise, sizes, out=None):
    """(source, plan, local_error, sizes as a checked tuple or None): ``local_error`` is set
    only on the ``sizes=`` steady state when this rank's input does not fit the plan its
    peers use. An invalid input with well-formed ``sizes`` for which a plan is known, or
    malformed ``sizes`` with an input a known ``sizes=`` plan gathers, raises here, after
    joining that plan's collectives (:func:`join_peers_and_raise`)."""
    given = sizes is not None
    src, sizes, error = _checked_input(comm, x, recipe, rowwise, columnwise, sizes)
    cache = plan_cache(comm)
    if error is not None and given and comm.size > 1:
        join_peers_and_raise(comm, cache, sizes, src, out, error)
    key = None if error is not None else local_key(src, sizes)
    plan = None if key is None else cache.get(key)
    if comm.size == 1:
        if error is not None:
            raise error
    elif sizes is not None and plan is not None:
        problem = plan.expects(src)
        cache.hits += 1
        if problem is None:
            cache.note_sizes_call(plan, data_ops(plan, src))
        return src, plan, (None if problem is None else ValueError(
            f"gather_along_first_dim: {problem}; this rank joined the collectives with zeros "
            f"so that no rank waits forever (the other ranks received zeros for its rows "
            f"and raise too, {PEERS_RAISE}): pass the true sizes")), sizes
    else:
        # The check (a probe of fp8blk.comm.agree): every rank found the same plan. A
        # miss with sizes= makes it too (then exchanges), so that a miss issues the same two
        # host collectives whether or not the ranks passed sizes=.
        mark = plan.table_hash if plan is not None else -1 - comm.rank
        agreed = all_agree(comm, [mark], comm.meta_all_reduce_max).same()
        if plan is not None and agreed:
            cache.hits += 1
            return src, plan, None, sizes
        plan = None
    if plan is not None:  # world size 1
        cache.hits += 1
        return src, plan, None, sizes
    cache.misses += 1
    columns, table_hash = exchange(comm, src, sizes, error)
    plan = Plan(src, columns, comm.size, comm.rank, table_hash, sized=sizes is not None)
    cache.put(key, plan)
    if sizes is not None and comm.size > 1:
        cache.note_sizes_call(plan, data_ops(plan, src))
    return src, plan, None, sizes


def _checked_input(comm, x, recipe, rowwise, columnwise, sizes):
    """(source or None, sizes as a checked tuple or None, this rank's error or None). Sizes
    are checked apart from the input, so that an invalid input still knows them; malformed
    sizes are dropped (that rank then looks for its peers' plan by its input, see
    :func:`join_peers_and_raise`)."""
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


__all__ = ["resolve"]
