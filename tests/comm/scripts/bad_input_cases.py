"""Multi-rank bad-input cases of ``cast_master_weights``, shared by the in-process
thread-rank tests (tests/test_bad_input.py) and the MPI suite (bad_input_suite.py).

Each case runs on every rank with the same arguments but the rank, and must end with either a
correct result (checked locally: this rank's bytes at its own range and the complete scales
equal quantize(bf16(full weight))) or a clear exception on every rank (``expect(rank, size)``
gives the exception type and a regex its message must match). The cases run in sequence on
one communicator, so they also check that the ranks' agreement state stays consistent across
errors; a case with ``fresh=True`` starts on a new communicator (no verified batch yet).
"""
from __future__ import annotations

import re

import numpy as np

import fp8blk as fb
from fp8blk.master import cast_master_weights
from fp8blk.tensor import internal_buffers
from tests.master.scripts import cases

BF16 = cases.BF16
CASES = []


def case(expect=None, min_size=2, fresh=False):
    def register(fn):
        CASES.append((fn.__name__, fn, expect, min_size, fresh))
        return fn
    return register


def everyone(kind, pattern):
    return lambda rank, size: (kind, pattern)


# --------------------------------------------------------------------------------------------
# Building blocks


def _spec(shape=(300, 257), recipe=None, columnwise=False):
    return cases.Spec(shape, recipe or fb.Block2D(fb.E4M3, pow2_scales=False),
                      columnwise=columnwise)


MIXED = [_spec((300, 257), fb.Block2D(fb.E4M3, pow2_scales=False), columnwise=True),
         _spec((128, 96), fb.MXFP8(fb.E5M2), columnwise=True)]
OTHER = [_spec((160, 130), fb.Block2D(fb.E5M2))]


def _even(spec, size, shift=0):
    """(start, count) per rank: contiguous cuts, moved by `shift` elements (ranks' shares
    change, the tiling stays exact)."""
    total = spec.shape[0] * spec.shape[1]
    cuts = [min(total, max(0, total * r // size + (shift if 0 < r < size else 0)))
            for r in range(size + 1)]
    return [(cuts[r], cuts[r + 1] - cuts[r]) for r in range(size)]


def _fulls(specs, seed):
    rng = np.random.default_rng(seed)
    return [cases.make_full(rng, s.shape) for s in specs]


def _inputs(specs, fulls, ranges, rank, dtype=np.float32):
    masters, starts = [], []
    for spec, full, per_rank in zip(specs, fulls, ranges):
        o, n = per_rank[rank]
        masters.append(full.reshape(-1)[o: o + n].astype(dtype) if n else None)
        starts.append(o)
    return masters, starts


def _weights(specs, rank):
    rng = np.random.default_rng([99, rank])
    return [cases.alloc_weight(s, rng) for s in specs]


def _call(comm, specs, fulls, ranges, rank, weights=None, model_dtype=BF16):
    weights = weights or _weights(specs, rank)
    masters, starts = _inputs(specs, fulls, ranges, rank)
    cast_master_weights(weights, masters, starts, comm, model_dtype=model_dtype)
    return weights


def check_local(specs, fulls, ranges, rank, weights, model_dtype=BF16):
    """This rank's bytes at [o, o+n) and its (complete) scales equal quantize's."""
    for i, (spec, full) in enumerate(zip(specs, fulls)):
        want = cases.expected_buffers(spec, full, model_dtype)
        got = internal_buffers(weights[i])
        h, w = spec.shape
        o, n = ranges[i][rank]
        flat = np.arange(o, o + n)
        for d in (0, 2):
            if want[d] is None:
                continue
            np.testing.assert_array_equal(got[d + 1].view(np.uint8), want[d + 1].view(np.uint8),
                                          err_msg=f"weights[{i}] scales, direction {d}")
            transposed = d == 2 and isinstance(spec.recipe, fb.Block2D)
            pos = (flat % w) * h + flat // w if transposed else flat
            np.testing.assert_array_equal(got[d].reshape(-1)[pos], want[d].reshape(-1)[pos],
                                          err_msg=f"weights[{i}] data, direction {d}")


def _valid(comm, rank, size, specs, seed, shift=0, weights=None, calls=None):
    fulls = _fulls(specs, seed)
    ranges = [_even(s, size, shift) for s in specs]
    comm.reset_stats()
    weights = _call(comm, specs, fulls, ranges, rank, weights)
    check_local(specs, fulls, ranges, rank, weights)
    if calls is not None:  # the steady state: one data collective per recipe bucket
        assert comm.stats.calls == calls, (calls, comm.stats)
    return weights


def _buckets(specs):
    return len({type(s.recipe) for s in specs})


# --------------------------------------------------------------------------------------------
# Cases (in the order they run)


@case(fresh=True)
def valid_then_steady(comm, rank, size):
    weights = None
    for step in range(3):  # step 0 verifies; then exactly one collective per bucket
        weights = _valid(comm, rank, size, MIXED, seed=step, weights=weights,
                         calls=_buckets(MIXED) if step else None)


@case(everyone(ValueError, r"disagree on the number of weights"))
def count_differs(comm, rank, size):
    specs = MIXED if rank == 0 else MIXED[:1]
    _call(comm, specs, _fulls(specs, 1), [_even(s, size) for s in specs], rank)


@case(everyone(ValueError, r"disagree on the number of weights"))
def one_rank_empty_lists_after_steady(comm, rank, size):
    _valid(comm, rank, size, MIXED, seed=3)
    if rank == size - 1:
        cast_master_weights([], [], [], comm)
    else:
        _call(comm, MIXED, _fulls(MIXED, 4), [_even(s, size) for s in MIXED], rank)


@case(everyone(ValueError, r"disagree on the number of weights"), fresh=True)
def one_rank_empty_lists_fresh(comm, rank, size):
    if rank == 0:
        cast_master_weights([], [], [], comm)
    else:
        _call(comm, MIXED, _fulls(MIXED, 4), [_even(s, size) for s in MIXED], rank)


def _differ(comm, rank, size, mine, theirs):
    specs = [mine if rank == 0 else theirs]
    _call(comm, specs, _fulls(specs, 5), [_even(s, size) for s in specs], rank)


@case(everyone(ValueError, r"disagree on weights\[0\].*Block2D.*MXFP8"))
def recipe_differs(comm, rank, size):
    _differ(comm, rank, size, _spec((128, 128), fb.Block2D()), _spec((128, 128), fb.MXFP8()))


@case(everyone(ValueError, r"disagree on weights\[0\].*E4M3.*E5M2"))
def format_differs(comm, rank, size):
    _differ(comm, rank, size, _spec((256, 128), fb.MXFP8(fb.E4M3)),
            _spec((256, 128), fb.MXFP8(fb.E5M2)))


@case(everyone(ValueError, r"disagree on weights\[0\].*128x256.*256x128"))
def shape_differs_same_tile_count(comm, rank, size):
    _differ(comm, rank, size, _spec((128, 256)), _spec((256, 128)))


@case(everyone(ValueError, r"disagree on weights\[0\].*pow2_scales=True.*pow2_scales=False"))
def pow2_differs(comm, rank, size):
    _differ(comm, rank, size, _spec(recipe=fb.Block2D(pow2_scales=True)),
            _spec(recipe=fb.Block2D(pow2_scales=False)))


@case(everyone(ValueError, r"disagree on weights\[0\].*amax_epsilon=0\.001"))
def epsilon_differs(comm, rank, size):
    _differ(comm, rank, size, _spec(recipe=fb.Block2D(amax_epsilon=1e-3)),
            _spec(recipe=fb.Block2D()))


@case(everyone(ValueError, r"disagree on weights\[0\].*rowwise\+columnwise.*holding rowwise\b"))
def directions_differ(comm, rank, size):
    _differ(comm, rank, size, _spec((128, 64), fb.MXFP8(), columnwise=True),
            _spec((128, 64), fb.MXFP8(), columnwise=False))


@case(everyone(ValueError, r"disagree on model_dtype.*bfloat16.*float32"))
def model_dtype_differs(comm, rank, size):
    specs = MIXED
    _call(comm, specs, _fulls(specs, 6), [_even(s, size) for s in specs], rank,
          model_dtype=BF16 if rank == 0 else np.float32)


def _bad_rank_expect(bad):
    def expect(rank, size):
        if rank == bad:
            return TypeError, r"masters\[0\] must be float32 or bfloat16"
        return ValueError, rf"rank\(s\) \[{bad}\] rejected their arguments"
    return expect


@case(_bad_rank_expect(1))
def invalid_master_on_one_rank(comm, rank, size):
    specs = MIXED
    fulls = _fulls(specs, 7)
    ranges = [_even(s, size) for s in specs]
    masters, starts = _inputs(specs, fulls, ranges, rank)
    if rank == 1:
        masters[0] = np.zeros(masters[0].size, np.float16)
    cast_master_weights(_weights(specs, rank), masters, starts, comm)


@case(_bad_rank_expect(1), fresh=True)
def invalid_master_on_one_rank_fresh(comm, rank, size):
    invalid_master_on_one_rank(comm, rank, size)


@case(everyone(ValueError, r"weights\[0\].*leave \[\d+, \d+\) uncovered"))
def gap(comm, rank, size):
    specs = MIXED
    ranges = [_even(s, size) for s in specs]
    o, n = ranges[0][0]
    ranges[0][0] = (o, n - 7)  # rank 0 forgets its last 7 elements
    _call(comm, specs, _fulls(specs, 8), ranges, rank)


@case(everyone(ValueError, r"weights\[1\].*overlap on \[\d+, \d+\)"))
def overlap(comm, rank, size):
    specs = MIXED
    ranges = [_even(s, size) for s in specs]
    o, n = ranges[1][1]
    ranges[1][1] = (o - 5, n + 5)  # rank 1 also takes rank 0's last 5 elements
    _call(comm, specs, _fulls(specs, 9), ranges, rank)


@case(everyone(ValueError, r"weights\[1\].*uncovered"))
def gap_after_steady(comm, rank, size):
    """Steady state, then one rank alone changes its shard: it misses the verified batch while
    the others hit; all of them must still meet, and raise."""
    _valid(comm, rank, size, MIXED, seed=10)
    _valid(comm, rank, size, MIXED, seed=11, calls=_buckets(MIXED))
    ranges = [_even(s, size) for s in MIXED]
    if rank == size - 1:
        o, n = ranges[1][rank]
        ranges[1][rank] = (o + 1, n - 1)
    _call(comm, MIXED, _fulls(MIXED, 12), ranges, rank)


@case()
def valid_after_errors(comm, rank, size):
    weights = _valid(comm, rank, size, MIXED, seed=13)
    _valid(comm, rank, size, MIXED, seed=14, weights=weights, calls=_buckets(MIXED))


@case(min_size=3)
def repartition_some_ranks_keep_their_shard(comm, rank, size):
    """Rank 0 keeps its shard while the others' move: rank 0 hits, the others miss, the new
    tiling is exact -- a correct result."""
    specs = MIXED
    weights = _valid(comm, rank, size, specs, seed=15)
    _valid(comm, rank, size, specs, seed=16, shift=0, weights=weights, calls=_buckets(specs))
    total_last = [s.shape[0] * s.shape[1] for s in specs]
    ranges = []
    for s, total in zip(specs, total_last):
        even = _even(s, size)
        o1, _ = even[1]
        cut = o1 + (even[1][1] // 2)  # ranks >= 1 re-cut; rank 0 unchanged
        ranges.append([even[0], (o1, cut - o1)] + [
            (cut + (total - cut) * (r - 2) // (size - 2),
             (total - cut) * (r - 1) // (size - 2) - (total - cut) * (r - 2) // (size - 2))
            for r in range(2, size)])
    fulls = _fulls(specs, 17)
    weights = _call(comm, specs, fulls, ranges, rank, weights)
    check_local(specs, fulls, ranges, rank, weights)


@case()
def alternating_batches(comm, rank, size):
    """Two batches in turn (e.g. two model chunks per step): after one cycle, each call is the
    steady state again (the prediction follows the cycle)."""
    wa, wb = _weights(MIXED, rank), _weights(OTHER, rank)
    for step in range(6):
        specs, weights = (MIXED, wa) if step % 2 == 0 else (OTHER, wb)
        _valid(comm, rank, size, specs, seed=20 + step, weights=weights,
               calls=_buckets(specs) if step >= 3 else None)


@case()
def all_ranks_empty(comm, rank, size):
    comm.reset_stats()
    for _ in range(2):
        cast_master_weights([], [], [], comm)
    assert comm.stats.calls == 0, comm.stats


@case(_bad_rank_expect(0))
def invalid_master_after_steady(comm, rank, size):
    _valid(comm, rank, size, MIXED, seed=30)
    invalid_master_on_one_rank_bad0(comm, rank, size)


def invalid_master_on_one_rank_bad0(comm, rank, size):
    specs = MIXED
    fulls = _fulls(specs, 31)
    ranges = [_even(s, size) for s in specs]
    masters, starts = _inputs(specs, fulls, ranges, rank)
    if rank == 0:
        masters[0] = np.zeros(masters[0].size, np.float16)
    cast_master_weights(_weights(specs, rank), masters, starts, comm)


@case()
def valid_at_the_end(comm, rank, size):
    _valid(comm, rank, size, MIXED + OTHER, seed=40)


# --------------------------------------------------------------------------------------------
# Running


def run_case(comm, rank, size, name, fn, expect):
    """'ok' or a line saying what went wrong on this rank."""
    try:
        fn(comm, rank, size)
    except Exception as exc:  # noqa: BLE001 - compared with the expectation below
        if expect is None:
            return f"{name}: rank {rank} raised {type(exc).__name__}: {exc}"
        kind, pattern = expect(rank, size)
        if not isinstance(exc, kind) or not re.search(pattern, str(exc)):
            return (f"{name}: rank {rank} raised {type(exc).__name__}: {exc} -- expected "
                    f"{kind.__name__} matching {pattern!r}")
        return "ok"
    if expect is not None:
        return f"{name}: rank {rank} returned, expected {expect(rank, size)}"
    return "ok"
