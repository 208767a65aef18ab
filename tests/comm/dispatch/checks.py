"""The all-to-alls' checks (``Communicator.all_to_all_v``, ``quantized_all_to_all``,
``high_precision_all_to_all``), run on every rank by ``run_suite`` of
tests/comm/scripts/checks.py in the launches of tests/comm/test_multirank.py (MPI at 1-4
ranks, gloo at 2-4). Every rank builds every rank's rows and counts from the suite's shared
seed, so it knows the rows it must receive and compares with ``fb.quantize`` of them, byte for
byte."""
from __future__ import annotations

import numpy as np

import fp8blk as fb
from fp8blk.comm import high_precision_all_to_all, quantized_all_to_all
from tests._same import to_host
from tests.comm.gather.checks import gather_input
from tests.comm.scripts.checks import BF16, Suite

POW2, FP32 = fb.Block1D(), fb.Block1D(fb.E5M2, pow2_scales=False, amax_epsilon=1e-3)


def half(fam):
    """The 16-bit float the family holds as such: bfloat16, or float16 for CuPy (which has no
    bfloat16; its uint16 arrays are not rows of floats)."""
    return np.dtype(np.float16) if fam.name == "cupy" else BF16


def counts_matrix(rng, n, skew):
    """(n, n) rows sent from rank r to rank p: skewed (some peers get many, some none) or
    even."""
    if not skew:
        return np.full((n, n), 3, dtype=np.int64)
    counts = rng.integers(0, 9, (n, n)) * rng.integers(0, 2, (n, n))  # about half are zero
    counts[:, rng.integers(n)] += 40  # one hot expert rank
    return counts


def every_rank_rows(rng, counts, k, dtype):
    """Each rank's rows (grouped by destination), spanning eight decades, and in rows of
    their own: values near 1e-37 (the scale overflows: scale_inv 2^-127, the one subnormal
    scale the one-byte wire carries), zeros, inf and NaN, 3e38."""
    rows = []
    for r in range(counts.shape[0]):
        x = gather_input(rng, int(counts[r].sum()), k)
        special = rng.permutation(len(x))[:4]
        for i, value in zip(special, (1e-37, 0.0, np.inf, 3e38)):
            x[i] = value * rng.uniform(0.5, 1.0, k)
        if len(special) > 2:
            x[special[2], ::3] = np.nan
        rows.append(x.astype(dtype))
    return rows


def received(rows, counts, me):
    """The rows rank ``me`` receives: from each rank, its block for ``me``, by source."""
    blocks = []
    for r, x in enumerate(rows):
        start = int(counts[r, :me].sum())
        blocks.append(x[start: start + int(counts[r, me])])
    return np.concatenate(blocks)


def _same_quantized(s, got, want, label):
    for name in ("rowwise_data", "rowwise_scale_inv"):
        g, w = to_host(getattr(got, name)), to_host(getattr(want, name))
        s.check(g.shape == w.shape and g.dtype.itemsize == w.dtype.itemsize
                and g.tobytes() == w.tobytes(), f"{label}: {name} differs "
                f"({g.shape} vs {w.shape})")
    s.check(got.columnwise_data is None, f"{label}: rowwise only")


def check_quantized(s: Suite):
    """Byte-exact against fb.quantize of the received rows: skewed and even counts, zero
    counts, K not a multiple of 128, both scale wires, float32 and bfloat16 rows, recv_counts
    given or learned, synchronous and asynchronous, out= reuse."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    cases = [(POW2, np.float32, 200, True), (FP32, np.float32, 128, True),
             (POW2, half(fam), 384, False), (FP32, half(fam), 1, True),
             (POW2, np.float32, 130, True)]
    for i, (recipe, dtype, k, skew) in enumerate(cases):
        rng = s.rng()
        counts = counts_matrix(rng, n, skew)
        rows = every_rank_rows(rng, counts, k, dtype)
        want = fb.quantize(received(rows, counts, me), recipe)
        given = counts[:, me].tolist() if i % 2 else None
        label = f"quantized {recipe} {np.dtype(dtype)} k={k} counts={counts.tolist()}"
        q, recv, handle = quantized_all_to_all(fam.make(rows[me]), comm, counts[me].tolist(),
                                               recipe, recv_counts=given, async_op=i == 2)
        if handle is not None:
            s.check(handle.wait() is q, f"{label}: wait() returns the result")
        s.check(recv == counts[:, me].tolist(), f"{label}: recv counts {recv}")
        s.check(q.dtype == np.dtype(dtype) and q.shape == want.shape, f"{label}: {q!r}")
        _same_quantized(s, q, want, label)
        # out= reuse: new rows, same counts, the same BlockTensor written in place
        rows = every_rank_rows(rng, counts, k, dtype)
        again, _, _ = quantized_all_to_all(fam.make(rows[me]), comm, counts[me].tolist(),
                                           recipe, out=q)
        s.check(again is q, f"{label}: out= returned")
        _same_quantized(s, q, fb.quantize(received(rows, counts, me), recipe), label + " out=")


def check_wire_bytes(s: Suite):
    """The communicator's stats: the quantized all-to-all's bytes against a bf16 all-to-all of
    the same rows, <= 0.51 with one-byte power-of-two scales, <= 0.52 with fp32 scales."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    rng = s.rng()
    counts = counts_matrix(rng, n, True) + 1  # every rank sends rows
    k = 1024
    rows = every_rank_rows(rng, counts, k, np.float32)
    comm.reset_stats()
    high_precision_all_to_all(fam.make(rows[me].astype(half(fam))), comm, counts[me].tolist())
    bf16 = comm.stats.ops["high_precision_all_to_all"][1]
    s.check(bf16 == counts[me].sum() * k * 2, f"bf16 bytes {bf16}")
    for recipe, bound, per_row in ((POW2, 0.51, k + 8), (FP32, 0.52, k + 32)):
        comm.reset_stats()
        quantized_all_to_all(fam.make(rows[me]), comm, counts[me].tolist(), recipe)
        sent = comm.stats.ops["quantized_all_to_all"][1]
        s.check(sent == counts[me].sum() * per_row and comm.stats.calls == 1
                and comm.stats.meta_calls == 1, f"{recipe}: {comm.stats}")
        s.check(sent <= bound * bf16, f"{recipe}: {sent} bytes vs bf16 {bf16}")


def check_combine_and_plain(s: Suite):
    """The combine sends the dispatched rows back (counts transposed) in bf16 and fp32 and
    gives each rank its own rows; all_to_all_v moves any dtype and row shape."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    rng = s.rng()
    counts = counts_matrix(rng, n, True)
    for dtype in (half(fam), np.float32):
        rows = every_rank_rows(rng, counts, 72, dtype)
        mine = received(rows, counts, me)
        back = [received(rows, counts, r) for r in range(n)]  # what each rank holds now
        got, recv, handle = high_precision_all_to_all(fam.make(back[me]), comm,
                                                      counts[:, me].tolist(),
                                                      recv_counts=counts[me].tolist(),
                                                      async_op=dtype != np.float32)
        if handle is not None:
            s.check(handle.wait() is got, "combine: wait() returns the rows")
        s.equal(fam.back(got, np.dtype(dtype)), rows[me], f"combine {np.dtype(dtype)}")
        s.check(recv == counts[me].tolist(), f"combine recv {recv}")
        s.equal(mine, received(rows, counts, me), "received() is stable")
    ints = [rng.integers(-2**40, 2**40, (int(counts[r].sum()), 3, 2)) for r in range(n)]
    out = comm.all_to_all_v(fam.make(ints[me]), counts[me])
    s.equal(fam.back(out), received(ints, counts, me), "all_to_all_v int64 (rows, 3, 2)")
    handle = comm.all_to_all_v(fam.make(ints[me]), counts[me], out=out, async_op=True)
    s.check(handle.wait() is out, "all_to_all_v async: wait() returns out")
    s.equal(fam.back(out), received(ints, counts, me), "all_to_all_v out= async")


def _raises_everywhere(s, label, fn, contains, culprit=None, culprit_contains=None):
    """fn() raises a ValueError naming ``contains`` on every rank (on rank ``culprit``, its
    own error naming ``culprit_contains`` where given); then the communicator still works (no
    message of the failed call is left in flight)."""
    comm = s.comm
    error = s.raises(Exception, fn, label)
    if comm.rank == culprit and culprit_contains is not None:
        contains = culprit_contains
    s.check(isinstance(error, ValueError) and contains in str(error), f"{label}: {error!r}")
    _, recv, _ = quantized_all_to_all(np.ones((comm.size, 128), np.float32), comm,
                                      [1] * comm.size)
    s.check(recv == [1] * comm.size, f"{label}: the next call works")


def check_errors(s: Suite):
    """Each bad input raises on every rank, naming the rank and the value."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    last = n - 1
    x = fam.make(np.ones((2 * n, 256), np.float32))
    even = [2] * n

    def call(rows=x, counts=even, recipe=POW2, recv=None):
        return quantized_all_to_all(rows, comm, counts, recipe, recv_counts=recv)
    sums = [2] * n
    sums[0] += 1 if me == last else 0
    _raises_everywhere(s, "counts not summing", lambda: call(counts=sums),
                       f"rank {last}'s send_counts sum to {2 * n + 1} but it passes {2 * n}")
    negative = [2] * n
    if me == 0:
        negative[-1] = -1
    _raises_everywhere(s, "negative count", lambda: call(counts=negative),
                       f"rank 0's send_counts[{last}] is -1")
    _raises_everywhere(s, "wrong number of counts",
                       lambda: call(counts=even + [0] if me == 0 else even),
                       f"rank 0's send_counts is {n + 1} counts")
    _raises_everywhere(s, "a rank's input rejected", lambda: call(
        rows=fam.make(np.ones((2 * n, 4, 64), np.float32)) if me == last else x),
        f"rank {last} rejected its own input", last, "takes rows (N, K)")
    wrong = fam.make(np.empty((2 * n + (1 if me == last else 0), 256), np.float32))
    _raises_everywhere(s, "out of other rows", lambda: comm.all_to_all_v(x, even, out=wrong),
                       f"rank {last}'s out has {2 * n + 1} rows but it receives {2 * n}")
    if n == 1:
        return
    wide = fam.make(np.ones((2 * n, 384), np.float32))
    _raises_everywhere(s, "hidden size", lambda: call(rows=wide if me == last else x),
                       f"hidden size (elements per row): rank 0 has 256, rank {last} has 384")
    other = fam.make(np.ones((2 * n, 256), half(fam)))
    _raises_everywhere(s, "dtype", lambda: call(rows=other if me == last else x),
                       f"dtype: rank 0 has float32, rank {last} has {half(fam)}")
    _raises_everywhere(s, "recipe", lambda: call(recipe=FP32 if me == last else POW2),
                       f"the recipe: rank 0 has {POW2!r}, rank {last} has {FP32!r}")
    expect = list(even)
    if me == 0:
        expect[last] = 5
    _raises_everywhere(s, "a peer expects other counts", lambda: call(recv=expect),
                       f"rank {last} sends 2 rows to rank 0, but rank 0 expects 5 from rank "
                       f"{last}")
    # the combine and the plain all-to-all read the same table
    _raises_everywhere(s, "combine hidden size", lambda: high_precision_all_to_all(
        wide if me == last else x, comm, even), "hidden size")
    _raises_everywhere(s, "all_to_all_v counts", lambda: comm.all_to_all_v(x, sums),
                       f"rank {last}'s send_counts sum to")


def run_dispatch_checks(s: Suite, parts):
    if "dispatch" in parts:
        check_quantized(s)
        check_wire_bytes(s)
        check_combine_and_plain(s)
        check_errors(s)
