"""Stream-ordered 2-D copies and fills between raw device addresses, for the gather's fix-up
(:mod:`fp8blk.comm.gather.fixup`): each is ONE CUDA runtime call (``cudaMemcpy2DAsync``,
``cudaMemsetAsync``), enqueued on an explicit stream. Raw addresses serve CuPy arrays and torch
CUDA tensors alike (``data.ptr`` / ``data_ptr()``), so neither family builds a view or launches
a strided-copy kernel per call: the calls are worked out once (addresses, pitches, sizes) and
replayed, each replay a CuPy Cython wrapper around the runtime call (no views, no kernels
of our own, nothing allocated).

``Copies(runtime)`` wraps a runtime with CuPy's signatures (``cupy.cuda.runtime``; the CPU
tests pass a host stand-in that moves bytes with ctypes); :func:`cuda_copies` is the CUDA one.
The same object makes the device-to-host copies and events of the gather's in-band status
(:mod:`fp8blk.comm.gather.status`): a copy into host memory and an event recorded after it,
both enqueued on a stream, and the event queried later without blocking.
"""
from __future__ import annotations

import numpy as np

_cuda = []


class Copies:
    """Calls ``(function, args)`` of a runtime, built once; ``function(*args)`` enqueues one
    (the caller replays its list of them in order)."""

    def __init__(self, runtime, host_buffer=None):
        self.runtime = runtime
        self._copy2d = runtime.memcpy2DAsync
        self._memset = runtime.memsetAsync
        self._kind = runtime.memcpyDeviceToDevice
        self._host_buffer = host_buffer

    def host_buffer(self, nbytes):
        """A uint8 NumPy array of ``nbytes`` in host memory the device can copy into
        asynchronously (page-locked on CUDA; plain host memory for a host stand-in)."""
        if self._host_buffer is None:
            return np.zeros(nbytes, np.uint8)
        return self._host_buffer(nbytes)

    def to_host(self, dst, src, nbytes, stream):
        """Enqueue a copy of ``nbytes`` from device address ``src`` to host address ``dst``."""
        runtime = self.runtime
        runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToHost, stream)

    def new_event(self):
        """A raw event handle (no timing), of the current device."""
        runtime = self.runtime
        return runtime.eventCreateWithFlags(runtime.eventDisableTiming)

    def record(self, event, stream):
        self.runtime.eventRecord(event, stream)

    def done(self, event):
        """Whether the work before ``event`` has completed (never blocks)."""
        return self.runtime.eventQuery(event) == 0

    def synchronize(self, event):
        """Block the host until the work before ``event`` has completed."""
        self.runtime.eventSynchronize(event)

    def copy2d(self, dst, dst_pitch, src, src_pitch, width, height, stream):
        """Copy ``height`` rows of ``width`` bytes (rows ``*_pitch`` bytes apart)."""
        return self._copy2d, (dst, dst_pitch, src, src_pitch, width, height, self._kind,
                              stream)

    def memset(self, dst, byte, nbytes, stream):
        return self._memset, (dst, byte, nbytes, stream)


def cuda_copies() -> Copies:
    """The CUDA runtime's calls, through CuPy (which the device kernels need anyway)."""
    if not _cuda:
        import cupy
        from cupy.cuda import runtime

        def pinned(nbytes):
            return np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)

        _cuda.append(Copies(runtime, pinned))
    return _cuda[0]


def uniform_byte(value, dtype):
    """The byte every byte of ``value`` as ``dtype`` equals (so memset writes it), or None."""
    raw = np.array(value, dtype=dtype).tobytes()
    return raw[0] if raw.count(raw[:1]) == len(raw) else None


__all__ = ["Copies", "cuda_copies", "uniform_byte"]
