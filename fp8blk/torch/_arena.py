"""Scratch device memory per CUDA stream and thread for the transient buffers of the eager hot
paths.

A Float8BlockLinear step makes FP8 copies that live for one GEMM only -- x's and W's rowwise
copies in the forward pass, dY's two copies and W's columnwise copy in the backward pass --
and cuBLASLt workspaces. Taking each from torch's caching allocator costs a Python call and
an allocation per buffer on every step. An arena is one allocation per (device, stream,
thread) that a caller carves at fixed byte offsets instead: the buffers of one call are dead
once that call's kernels are queued, and everything queued later on the same stream runs
after them, so the next call may write the same bytes (the allocator's own rule for memory
freed and reused on one stream). Two threads queuing on one stream would interleave their
calls' launches, hence one arena per thread (autograd's device thread runs the backward
passes: it has its own). Its size is the largest call's need, kept until :func:`release`; a
thread keeps 16 arenas, the one made first dropped when a 17th stream needs one.

What must not live here: anything that outlives the call (outputs, saved tensors, buffers
handed to other layers by the sharing scope), and anything made during CUDA-graph capture
(a graph replays its kernels on these addresses long after: the callers take torch's
allocator there, i.e. the graph's private pool).

    base = reserve(device_index, raw_stream, nbytes, device)  # this thread's arena: the
                                            # address of >= nbytes of scratch memory
"""
from __future__ import annotations

import threading
import weakref

import torch

_GRAIN = 2 << 20            # sizes rounded up to 2 MiB: fewer regrowths as plans appear
ALIGN = 256                 # each carved buffer's alignment (cuBLASLt's and the kernels' need)


class Arena:
    """One stream's scratch allocation: ``reserve(nbytes, device) -> address``, grown (the
    old allocation freed in the stream's order) when a call needs more than it holds."""

    __slots__ = ("buffer", "ptr", "nbytes", "__weakref__")

    def __init__(self):
        self.buffer, self.ptr, self.nbytes = None, 0, 0

    def reserve(self, nbytes: int, device) -> int:
        if nbytes > self.nbytes:
            self.buffer = None      # freed first: its memory may serve the larger allocation
            size = -(-nbytes // _GRAIN) * _GRAIN
            self.buffer = torch.empty((size,), dtype=torch.uint8, device=device)
            self.ptr, self.nbytes = self.buffer.data_ptr(), size
        return self.ptr

    def drop(self):
        self.buffer, self.ptr, self.nbytes = None, 0, 0


_BOUND = 16     # arenas a thread keeps (the oldest dropped first)


class _Local(threading.local):
    """This thread's arenas, (device index, raw stream) -> Arena: a dict lookup per call,
    no lock (another thread never reads them but through :data:`_every`)."""

    def __init__(self):
        self.arenas = {}


_local = _Local()
_every = weakref.WeakSet()      # every thread's arenas, for held() and release()
_lock = threading.Lock()        # guards _every


def for_stream(index: int, stream: int) -> Arena:
    """This thread's arena of CUDA device `index`'s stream `stream` (a raw cudaStream_t as an
    int; the legacy default stream is 0 on every device, hence the index in the key)."""
    arenas = _local.arenas
    arena = arenas.get((index, stream))
    if arena is None:
        if len(arenas) >= _BOUND:       # dropped: freed in its stream's order
            arenas.pop(next(iter(arenas))).drop()
        arena = arenas[(index, stream)] = Arena()
        with _lock:
            _every.add(arena)
    return arena


def reserve(index: int, stream: int, nbytes: int, device) -> int:
    """``for_stream(index, stream).reserve(nbytes, device)`` in one call: the hot paths'."""
    arena = _local.arenas.get((index, stream))
    if arena is None or nbytes > arena.nbytes:
        return for_stream(index, stream).reserve(nbytes, device)
    return arena.ptr


def release():
    """Free every thread's arenas (their memory returns to torch's caching allocator; the
    next call allocates again). Call it between steps: a step queuing work on another thread
    at the same time may have read an arena's address already."""
    with _lock:
        for arena in list(_every):
            arena.drop()


def held() -> int:
    """Bytes the arenas hold, all streams and threads together."""
    with _lock:
        return sum(a.nbytes for a in list(_every))


def carve(sizes):
    """Byte offsets for buffers of `sizes` bytes laid one after another, each at a multiple
    of :data:`ALIGN`; returns ``(offsets, total bytes)``. A size of 0 gets an offset too."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-int(size) // ALIGN) * ALIGN
    return offsets, end
