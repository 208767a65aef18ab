"""Quantized all-gather along dim 0: :func:`gather_along_first_dim` and the lookup of the plan
a call runs (this rank's input checked, the plan cache consulted, then the probe that every
rank found the same plan or the metadata exchange that makes a new one). docs/distributed.md
("Quantized all-gather") gives the paths, the cache protocol, errors, streams and the layout of
this package."""
from __future__ import annotations

import sys

from ... import _arrays
from ..agree import all_agree
from ..base import Communicator, Handle
from .paths import (PEERS_RAISE, GatherFallbackWarning, data_ops, gather_fallback, gather_fast,
                    gather_plain, gather_steady, join_peers_and_raise, join_with_zeros,
                    steady_lane, warn_once)
from .plan import FALLBACK, FAST, PLAIN, Plan, Source, check_sizes, exchange, local_key
from .status import cached_plans, check_pending, plan_cache, record_path, settle
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
    current stream wait for an event; it returns ``out``). See docs/distributed.md.

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
    some = src.x if not src.is_block else next(b for b in src.buffers if b is not None)
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


__all__ = ["gather_along_first_dim", "check_pending", "GatherFallbackWarning", "plan_cache",
           "FAST", "FALLBACK", "PLAIN"]
