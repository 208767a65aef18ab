"""The communicator test suite, shared by every multi-rank launcher (MPI, NCCL, torch): the
transport's checks (collectives, packed collectives) and ``run_suite``, which also runs the
quantized gather's checks (tests/comm/gather/checks.py) and the all-to-alls'
(tests/comm/dispatch/checks.py) in the same launch.

Each rank builds every rank's data from one seed that rank 0 draws and broadcasts, so each
rank can compute the expected result of a collective on its own. Checks raise AssertionError
with the seed and the case in the message; a launcher runs ``run_suite`` and prints
``SUITE OK <rank> <checks>`` at the end, which the pytest side counts.

Array families: ``Family`` adapts NumPy data to the array type under test (NumPy, CuPy, torch)
and back, so the same checks run on host and device buffers.
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

from fp8blk import _arrays
from fp8blk.comm import packed_all_gather, packed_all_reduce

BF16 = np.dtype(ml_dtypes.bfloat16)
REDUCE_DTYPES = [np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64),
                 np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]


# --------------------------------------------------------------------------------------------
# Families


class Family:
    """NumPy: arrays as they are."""

    name = "numpy"
    device = False

    def make(self, host):
        return np.array(host, copy=True)

    def back(self, arr, dtype=None):
        host = np.asarray(arr)
        return host if dtype is None else host.view(dtype)

    def strided(self, host):
        """A non-contiguous array with the values of ``host`` (2-D or more)."""
        wide = np.zeros(host.shape[:-1] + (2 * host.shape[-1],), dtype=host.dtype)
        wide[..., ::2] = host
        return self.make(wide)[..., ::2]

    def supports(self, dtype):
        return True


class CupyFamily(Family):
    name = "cupy"
    device = True

    def __init__(self):
        import cupy

        self.cupy = cupy

    def make(self, host):
        host = np.array(host, order="C")  # not ascontiguousarray: it turns 0-d into (1,)
        if host.dtype == BF16:
            host = host.view(np.uint16)  # CuPy has no bfloat16: bit patterns
        return self.cupy.asarray(host)

    def back(self, arr, dtype=None):
        host = self.cupy.asnumpy(arr)
        return host if dtype is None else host.view(dtype)

    def supports(self, dtype):
        return True


class TorchFamily(Family):
    name = "torch"

    def __init__(self, device="cpu"):
        import torch

        self.torch = torch
        self.torch_device = device
        self.device = device != "cpu"

    def make(self, host):
        tensor = _arrays.from_backend(np.array(host, copy=True), _arrays.TORCH)
        return tensor.to(self.torch_device)

    def back(self, arr, dtype=None):
        host, _, _ = _arrays.to_backend(arr.cpu())
        host = np.array(host, copy=True)
        return host if dtype is None else host.view(dtype)

    def strided(self, host):
        wide = np.zeros(host.shape[:-1] + (2 * host.shape[-1],), dtype=host.dtype)
        wide[..., ::2] = host
        return self.make(wide)[..., ::2]


# --------------------------------------------------------------------------------------------
# Infrastructure


class Suite:
    def __init__(self, comm, family, seed, label):
        self.comm, self.family, self.seed, self.label = comm, family, seed, label
        self.count = 0
        self._case = 0
        self.paths = {}  # gather path -> cases checked

    def rng(self):
        """A generator every rank draws identically from (one per case)."""
        self._case += 1
        return np.random.default_rng([self.seed, self._case])

    def check(self, condition, message):
        self.count += 1
        if not condition:
            raise AssertionError(f"[{self.label} rank {self.comm.rank}/{self.comm.size} "
                                 f"seed {self.seed}] {message}")

    def equal(self, got, expected, message):
        """Exact equality; floats compare as values with NaN == NaN (and -0 == +0)."""
        got, expected = np.asarray(got), np.asarray(expected)
        ok = got.shape == expected.shape and got.dtype == expected.dtype
        detail = f"got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
        if ok:
            if got.dtype.kind == "f" or got.dtype == BF16:
                g, e = got.astype(np.float64), expected.astype(np.float64)
                same = (g == e) | (np.isnan(g) & np.isnan(e))
            else:
                same = got == expected
            ok = bool(np.all(same))
            bad = np.argwhere(~same)
            detail += f"; {len(bad)} differ, first at {bad[:3].tolist()}"
        self.check(ok, f"{message}: {detail}")

    def raises(self, kind, fn, message, contains=None):
        try:
            fn()
        except kind as error:
            self.check(contains is None or contains in str(error),
                       f"{message}: wrong message {error}")
            return error
        self.check(False, f"{message}: no {kind.__name__} raised")


def shared_seed(comm):
    seed = np.array([int.from_bytes(os.urandom(4), "little")], dtype=np.int64)
    comm.broadcast(seed, root=0)
    return int(seed[0])


def values(rng, dtype, shape, op, size):
    """Data one rank contributes: exact-sum integers for "sum", specials for "max"."""
    if dtype.kind in "ui":
        if op == "sum":
            high = 255 // size if dtype == np.uint8 else 1000
            return rng.integers(0, high + 1, shape).astype(dtype)
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=np.int64 if dtype.itemsize == 8
                            else np.int64).astype(dtype)
    if op == "sum":
        # quarters of small integers: with up to 4 ranks every partial sum is a multiple of
        # 1/4 below 64, exact in bf16 (8 significant bits) whatever the order of summation
        return (rng.integers(-12, 13, shape) * 0.25).astype(dtype)
    values = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    flat = values.reshape(-1)
    for special in (np.nan, np.inf, -np.inf, 0.0, -0.0):
        if flat.size:
            flat[rng.integers(0, flat.size, max(1, flat.size // 16))] = special
    return values.astype(dtype)


def _reduce(stack, dtype, op):
    if op == "sum":
        return stack.astype(np.float64 if dtype.kind == "f" or dtype == BF16
                            else np.int64).sum(axis=0).astype(dtype)
    if dtype.kind in "ui":
        return stack.max(axis=0)
    return np.fmax.reduce(stack.astype(np.float64), axis=0).astype(dtype)


# --------------------------------------------------------------------------------------------
# Collectives


def check_collectives(s: Suite):
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    shapes = [(0,), (1,), (7,), (3, 5, 7), (130, 3)]
    for dtype in REDUCE_DTYPES:
        for op in ("sum", "max"):
            for shape in shapes:
                rng = s.rng()
                every = np.stack([values(rng, dtype, shape, op, n) for _ in range(n)])
                expected = _reduce(every, dtype, op)
                for async_op in (False, True):
                    buf = fam.make(every[me])
                    result = comm.all_reduce(buf, op=op, async_op=async_op, dtype=str(dtype))
                    if async_op:
                        got = result.wait()
                        s.check(got is buf and result.wait() is buf,
                                "all_reduce Handle.wait() returns the buffer, twice")
                    else:
                        s.check(result is None, "synchronous all_reduce returns None")
                    s.equal(fam.back(buf, dtype), expected,
                            f"all_reduce {op} {dtype} {shape} async={async_op}")
            # reduce_scatter: (n*rows, ...) -> rows of this rank
            rng = s.rng()
            rows = int(rng.integers(0, 4))
            every = np.stack([values(rng, dtype, (n * rows, 3), op, n) for _ in range(n)])
            expected = _reduce(every, dtype, op)[me * rows:(me + 1) * rows]
            inp = fam.make(every[me])
            out = comm.reduce_scatter(inp, op=op, dtype=str(dtype))
            s.equal(fam.back(out, dtype), expected, f"reduce_scatter {op} {dtype}")
            s.equal(fam.back(inp, dtype), every[me], "reduce_scatter leaves its input intact")
            handle = comm.reduce_scatter(fam.make(every[me]), op=op, async_op=True,
                                         dtype=str(dtype))
            s.equal(fam.back(handle.wait(), dtype), expected, f"async reduce_scatter {op}")

    # all_gather, all_gather_v, broadcast: bytes of any dtype
    for dtype in (np.dtype(np.uint8), BF16, np.dtype(np.float32), np.dtype(np.int64)):
        for rows in (0, 1, 5):
            rng = s.rng()
            every = [values(rng, dtype, (rows, 3, 2), "max", n) for _ in range(n)]
            expected = np.concatenate(every)
            got = comm.all_gather(fam.make(every[me]))
            s.equal(fam.back(got, dtype), expected, f"all_gather {dtype} rows={rows}")
            out = fam.make(np.zeros_like(expected))
            handle = comm.all_gather(fam.make(every[me]), out=out, async_op=True)
            s.check(handle.wait() is out and handle.wait() is out, "async all_gather -> out")
            s.equal(fam.back(out, dtype), expected, f"async all_gather into out {dtype}")
        if rows and dtype != BF16:
            strided = fam.strided(every[me].reshape(rows, 6))
            got = comm.all_gather(strided)
            s.equal(fam.back(got, dtype), expected.reshape(-1, 6), "all_gather strided input")
        rng = s.rng()
        counts = [int(c) for c in rng.integers(0, 6, n)]
        every = [values(rng, dtype, (c,), "max", n) for c in counts]
        for async_op in (False, True):
            got = comm.all_gather_v(fam.make(every[me]), counts, async_op=async_op)
            got = got.wait() if async_op else got
            s.equal(fam.back(got, dtype), np.concatenate(every), f"all_gather_v {counts}")
        for root in range(n):
            rng = s.rng()
            every = [values(rng, dtype, (4, 3), "max", n) for _ in range(n)]
            buf = fam.make(every[me])
            comm.broadcast(buf, root=root)
            s.equal(fam.back(buf, dtype), every[root], f"broadcast {dtype} root={root}")
    buf = fam.make(np.arange(6, dtype=np.float32) + me)
    comm.broadcast(buf, root=n - 1, async_op=True).wait()
    s.equal(fam.back(buf), np.arange(6, dtype=np.float32) + n - 1, "async broadcast")
    comm.barrier()

    # counters: data collectives with their bytes; barriers and metadata apart
    comm.reset_stats()
    buf = fam.make(np.ones((5, 7), np.float32))
    comm.all_reduce(buf, op="max")
    comm.all_gather(fam.make(np.ones((3, 2), np.uint8)))
    comm.reduce_scatter(fam.make(np.ones((2 * n, 4), np.float16)), dtype="float16")
    comm.barrier()
    st = comm.stats
    s.check(st.calls == 3 and st["calls"] == 3, f"stats.calls {st}")
    s.check(st.bytes == 140 + 6 + 2 * n * 4 * 2, f"stats.bytes {st}")
    s.check(st.meta_calls == 1 and st.ops["all_reduce"] == [1, 140], f"stats {st}")
    comm.reset_stats()
    s.check(comm.stats.calls == 0 and comm.stats.bytes == 0, "reset_stats")

    # argument errors are raised locally, before anything is sent (identically on all ranks)
    s.raises(ValueError, lambda: comm.all_reduce(fam.make(np.ones(3, np.float32)), op="min"),
             "op min")
    if not fam.device and fam.name == "numpy":
        wide = np.ones((4, 4), np.float32)
        s.raises(ValueError, lambda: comm.all_reduce(wide[:, ::2]), "strided in-place buffer",
                 contains="contiguous")
    s.raises(ValueError, lambda: comm.reduce_scatter(fam.make(np.ones((n * 2 + 1, 2),
                                                                      np.float32))),
             "reduce_scatter rows", contains="divisible") if n > 1 else None
    s.raises(TypeError, lambda: comm.all_reduce(fam.make(np.ones(3, np.int16))),
             "int16 reduction")
    s.check(comm.stats.calls == 0, "rejected calls send nothing")


# --------------------------------------------------------------------------------------------
# Packed helpers


def check_packed(s: Suite):
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    for dtype in (np.dtype(np.float32), BF16, np.dtype(np.uint8), np.dtype(np.float16)):
        for op in ("max", "sum"):
            rng = s.rng()
            shapes = [tuple(int(d) for d in rng.integers(0, 5, rng.integers(0, 3)))
                      for _ in range(int(rng.integers(1, 7)))]
            every = [[values(rng, dtype, shape, op, n) for shape in shapes] for _ in range(n)]
            arrays = [fam.make(a) for a in every[me]]
            comm.reset_stats()
            got = packed_all_reduce(comm, arrays, op, dtype=str(dtype))
            s.check(got is arrays, "packed_all_reduce returns its list")
            s.check(comm.stats.calls == 1 and comm.stats.meta_calls == 1,
                    f"packed_all_reduce: one data collective + one check {comm.stats}")
            for i, shape in enumerate(shapes):
                expected = _reduce(np.stack([every[r][i] for r in range(n)]), dtype, op)
                s.equal(fam.back(arrays[i], dtype), expected,
                        f"packed_all_reduce {op} {dtype} array {i} {shape}")
            arrays = [fam.make(a) for a in every[me]]
            comm.reset_stats()
            handle = packed_all_reduce(comm, arrays, op, check=False, async_op=True,
                                       dtype=str(dtype))
            s.check(handle.wait() is arrays and handle.wait() is arrays, "async packed")
            s.check(comm.stats.calls == 1 and comm.stats.meta_calls == 0, "check=False")
            for i in range(len(shapes)):
                expected = _reduce(np.stack([every[r][i] for r in range(n)]), dtype, op)
                s.equal(fam.back(arrays[i], dtype), expected, f"async packed {op} {dtype}")
    # strided targets are written back too
    if fam.name != "cupy":
        rng = s.rng()
        every = [values(rng, np.dtype(np.float32), (3, 8), "max", n) for _ in range(n)]
        target = fam.strided(every[me])
        packed_all_reduce(comm, [target], "max")
        s.equal(fam.back(target.contiguous() if fam.name == "torch" else target),
                _reduce(np.stack(every), np.dtype(np.float32), "max"), "strided packed target")

    # packed all-gather of mixed dtypes: FP8 bytes, fp32 scales, bf16
    rng = s.rng()
    shapes = [((int(rng.integers(0, 4)), 5), np.dtype(np.uint8)), ((3,), np.dtype(np.float32)),
              ((2, 2), BF16)]
    every = [[values(rng, d, shape, "max", n) for shape, d in shapes] for _ in range(n)]
    for async_op in (False, True):
        comm.reset_stats()
        got = packed_all_gather(comm, [fam.make(a) for a in every[me]], async_op=async_op)
        got = got.wait() if async_op else got
        s.check(comm.stats.calls == 1, "packed_all_gather: one data collective")
        for i, (shape, dtype) in enumerate(shapes):
            s.equal(fam.back(got[i], dtype), np.concatenate([every[r][i] for r in range(n)]),
                    f"packed_all_gather {dtype}")

    # layout mismatches: every rank raises the same clear error, nobody hangs
    if n > 1:
        extra = 1 if me == 0 else 0
        s.raises(ValueError, lambda: packed_all_reduce(
            comm, [fam.make(np.ones(4 + extra, np.float32))], "max"),
            "mismatched packed size", contains="disagree on the number")
        dtype = np.float32 if me == 0 else np.int32
        s.raises(ValueError, lambda: packed_all_reduce(
            comm, [fam.make(np.ones(4, dtype))], "max"),
            "mismatched packed dtype", contains="not on the layout")
        op = "max" if me == 0 else "sum"
        s.raises(ValueError, lambda: packed_all_reduce(comm, [fam.make(np.ones(4, np.float32))],
                                                       op),
                 "mismatched op", contains="not on the layout")
        s.raises(ValueError, lambda: packed_all_gather(
            comm, [fam.make(np.ones((2 + extra, 3), np.uint8))]),
            "mismatched packed_all_gather", contains="disagree")
    s.raises(TypeError, lambda: packed_all_reduce(
        comm, [fam.make(np.ones(2, np.float32)), fam.make(np.ones(2, np.float16))], "max"),
        "mixed dtypes", contains="one dtype")


def run_suite(comm, family, label, parts=("collectives", "packed", "gather", "dispatch")):
    seed = shared_seed(comm)
    s = Suite(comm, family, seed, label)
    if "collectives" in parts:
        check_collectives(s)
    if "packed" in parts:
        check_packed(s)
    # the gather's checks build on this module's Suite and Family: imported here, not above
    from tests.comm.dispatch.checks import run_dispatch_checks
    from tests.comm.gather.checks import run_gather_checks

    run_gather_checks(s, parts)
    run_dispatch_checks(s, parts)
    comm.barrier()
    print(f"SUITE OK {label} rank {comm.rank}/{comm.size} checks {s.count} seed {seed} "
          f"gather paths {sorted(s.paths.items())}", flush=True)
    sys.stdout.flush()
    return s.count
