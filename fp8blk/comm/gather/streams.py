"""The streams of a device gather and the running of its collective and post-processing:
the local quantize on the current stream; the collective and the fix-up on ``stream``
(default: the current one), which first waits for the current stream; an asynchronous
call's Handle waits for an event (device) or completes the collective (host backends)."""
from __future__ import annotations

import sys

from ... import _arrays
from ..base import Handle


_torch_external = {}


class DeviceStreams:
    """The compute (current) stream and the communication stream of one device gather, in
    the flavour of the arrays' family (CuPy streams for CuPy arrays, torch streams for torch
    tensors)."""

    def __init__(self, torch_flavour, stream):
        self.torch_flavour = torch_flavour
        if torch_flavour:
            import torch

            self.lib = torch
            if stream is None:  # the common case: no Stream objects (~5 us each in torch)
                self.compute = self.comm = None
                self.ptr = _arrays.torch_stream_ptr()
                self.same = True
                return
            self.compute = torch.cuda.current_stream()
            self.comm = _torch_stream(stream)
            self.ptr = self.comm.cuda_stream
            self.same = self.ptr == self.compute.cuda_stream
        else:
            import cupy

            self.lib = cupy
            self.compute = cupy.cuda.get_current_stream()
            self.comm = self.compute if stream is None else _cupy_stream(stream)
            self.ptr = self.comm.ptr
            self.same = self.ptr == self.compute.ptr

    def begin(self):
        """The communication stream waits for the work queued so far (the local quantize)."""
        if not self.same:
            self.comm.wait_event(self._record(self.compute))

    def _record(self, stream):
        if self.torch_flavour:
            return stream.record_event()
        return stream.record()

    def context(self):
        if self.same:
            return NULL
        if self.torch_flavour:
            return self.lib.cuda.stream(self.comm)
        return self.comm

    def torch_context(self):
        """For torch process groups, which order against torch's current stream."""
        if self.torch_flavour:
            return self.context()
        if self.ptr == 0:
            return NULL  # the legacy default stream is torch's default stream too
        return _torch().cuda.stream(_torch_stream_for_ptr(self.ptr))

    def end(self, async_op):
        """None (sync: the compute stream waits for the communication stream), or the event
        an asynchronous handle waits for."""
        if not async_op:
            if not self.same:
                self.compute.wait_event(self._record(self.comm))
            return None
        lib = self.lib
        if self.torch_flavour and self.comm is None:
            event = lib.cuda.current_stream().record_event()
        else:
            event = self._record(self.comm)
        if self.torch_flavour:
            return lambda: lib.cuda.current_stream().wait_event(event)
        return lambda: lib.cuda.get_current_stream().wait_event(event)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NULL = _Null()


def _torch():
    return sys.modules["torch"]


def _torch_stream_for_ptr(ptr):
    stream = _torch_external.get(ptr)
    if stream is None:
        stream = _torch_external[ptr] = _torch().cuda.ExternalStream(ptr)
    return stream


def _cupy_stream(stream):
    import cupy

    if isinstance(stream, cupy.cuda.Stream):
        return stream
    ptr = getattr(stream, "cuda_stream", None)
    if ptr is None:
        raise TypeError(f"stream must be a cupy.cuda.Stream or a torch.cuda.Stream, got "
                        f"{type(stream).__name__}")
    return cupy.cuda.ExternalStream(ptr)


def _torch_stream(stream):
    torch = _torch()
    if isinstance(stream, torch.cuda.Stream):
        return stream
    ptr = getattr(stream, "ptr", None)
    if ptr is None:
        raise TypeError(f"stream must be a torch.cuda.Stream or a cupy.cuda.Stream, got "
                        f"{type(stream).__name__}")
    return _torch_stream_for_ptr(ptr)


def run(comm, issue, post, streams, ptr, async_op, result, keep=None):
    """Issue the grouped gather (``issue(stream_ptr)``; None: nothing to gather), then
    ``post()`` (the fix-up). ``streams``/``ptr`` as :func:`streams_for` gives them. Returns
    the Handle (async) or None. ``keep``: the temporaries (staging, inputs) the issued work
    reads or writes; an asynchronous handle holds them until it is waited for, since the
    memory pools would otherwise hand their memory to new work on the caller's stream while
    the communication stream still uses it."""
    if streams is None:
        finish = None if issue is None else issue(ptr)
        if ptr is None and async_op:  # host arrays: complete in wait()
            return Handle(waiter=finish, post=post, result=result)
        # host arrays, or a synchronous device call on the current stream: the collective
        # and the fix-up are plain stream-ordered work there (a host backend staging device
        # arrays completes in finish())
        if finish is not None:
            finish()
        post()
        return None
    stream_ordered = comm.stream_ordered
    streams.begin()
    with streams.context():
        if issue is not None:
            with streams.torch_context() if comm.orders_torch_stream else NULL:
                finish = issue(streams.ptr)
                if finish is not None and (stream_ordered or not async_op):
                    finish()  # stream-ordered: only makes this stream wait, host goes on
                    finish = None
        else:
            finish = None
        if finish is None:
            post()
    if finish is not None:  # a host backend staging device arrays: complete in wait()
        def complete():
            with streams.context():
                finish()
                post()
            streams.end(False)
            return keep
        return Handle(waiter=complete, result=result)
    waiter = streams.end(async_op)
    if not async_op:  # the caller's stream waits for the communication stream already
        return None
    return Handle(waiter=waiter if keep is None else _holding(waiter, keep), result=result)


def _holding(waiter, keep):
    """``waiter`` that keeps ``keep`` alive for as long as the handle holds it."""
    def wait():
        waiter()
        return keep
    return wait


def streams_for(comm, ops, stream, async_op):
    """(streams, ptr) of a gather on ``ops``' arrays: (None, None) on the host; (None, the
    current stream's handle) for a synchronous device call on the current stream (no stream
    objects, no events: everything is ordered on that stream as it is enqueued); else the
    call's :class:`DeviceStreams` and its communication stream's handle. A TorchComm on
    CuPy arrays always takes the streams (torch's current stream must be CuPy's there)."""
    if not ops.device:
        return None, None
    if stream is None and not async_op and not (
            comm.orders_torch_stream and ops.name != _arrays.TORCH):
        return None, ops.current_stream_ptr()
    streams = DeviceStreams(ops.name == _arrays.TORCH, stream)
    return streams, streams.ptr


def issuer(comm, items):
    """``issue(stream_ptr)`` of a grouped gather of ``items`` (None when there are none)."""
    return comm.gather_parts_issuer(items) if items else None


def nothing():
    return None

