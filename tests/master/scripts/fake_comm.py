"""In-process stand-in for a communicator: every rank is a thread, ``all_reduce`` meets at a
barrier. Fast (no processes), strict (mismatched buffers raise instead of hanging) and faithful
where it matters: MAX propagates NaN the way a plain MPI MAX may, so a NaN that reaches the
reduce shows up in the result. Buffers may be NumPy or CuPy (GPU tests: every rank on one GPU).

Contract mirrored from fp8blk.comm: ``rank``, ``size``, ``all_reduce(buf, op="max"|"sum")`` in
place, ``stats`` with cumulative ``calls`` and ``bytes`` (payload bytes of this rank's buffers),
``reset_stats()``.
"""
from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import numpy as np

from tests.comm.fake_ranks import run_threads

_TIMEOUT_S = 60.0


def _module_of(buf):
    if isinstance(buf, np.ndarray):
        return np
    import cupy

    if isinstance(buf, cupy.ndarray):
        return cupy
    raise TypeError(f"ThreadComm.all_reduce takes NumPy or CuPy buffers, got {type(buf)}")


class _Group:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=_TIMEOUT_S)
        self.slots = [None] * size


class ThreadComm:
    def __init__(self, group, rank):
        self.group = group
        self.rank = rank
        self.size = group.size
        self.reset_stats()

    def reset_stats(self):
        self.stats = SimpleNamespace(calls=0, bytes=0, meta_calls=0)
        self._meta = 0

    @contextlib.contextmanager
    def metadata(self):
        """As fp8blk.comm: collectives inside count as ``meta_calls``, not ``calls``/``bytes``."""
        self._meta += 1
        try:
            yield self
        finally:
            self._meta -= 1

    def all_reduce(self, buf, op="max"):
        if op not in ("max", "sum"):
            raise ValueError(f"op must be 'max' or 'sum', got {op!r}")
        xp = _module_of(buf)
        if not buf.flags.c_contiguous:
            raise TypeError("ThreadComm.all_reduce takes a contiguous NumPy or CuPy buffer")
        g = self.group
        g.slots[self.rank] = (op, buf.copy())
        g.barrier.wait()
        ops = {s[0] for s in g.slots}
        layouts = {(s[1].dtype, s[1].shape) for s in g.slots}
        if len(ops) != 1 or len(layouts) != 1:
            g.barrier.abort()
            raise RuntimeError(f"ranks disagree on the all_reduce: ops {ops}, buffers {layouts}")
        stacked = xp.stack([s[1] for s in g.slots])
        # max propagates NaN (as a plain MPI MAX may): a NaN reaching the reduce shows up
        result = (xp.max(stacked, axis=0) if op == "max" else xp.sum(stacked, axis=0)
                  ).astype(buf.dtype)
        g.barrier.wait()
        buf[...] = result
        if self._meta:
            self.stats.meta_calls += 1
            return
        self.stats.calls += 1
        self.stats.bytes += buf.nbytes


def run_ranks(size, fn):
    """Run ``fn(rank, comm)`` on `size` threads; return the results by rank, re-raising the
    first exception (other ranks are released through the broken barrier)."""
    group = _Group(size)
    return run_threads(size, lambda rank: fn(rank, ThreadComm(group, rank)),
                       group.barrier.abort, _TIMEOUT_S * 4)
