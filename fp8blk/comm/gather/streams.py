"""Arrays, streams and raw copies of the gather (docs/distributed.md, "Quantized all-gather"):
the per-family array operations (extending fp8blk._arrays' families), the stream-ordered 2-D
copies and fills of the device fix-up and status, and the running of a gather's collective and
post-processing on the compute and communication streams."""
from __future__ import annotations

import sys

import numpy as np

from ... import _arrays
from ..base import Handle

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


U8 = np.dtype(np.uint8)


def _span(shape, strides):
    """Elements from the first to one past the last element of a strided view."""
    if not all(shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


class NumpyOps(_arrays.HostFamily):
    """The gather's array operations on one family (this one: NumPy; :class:`CupyOps`,
    :class:`TorchOps`), on top of the family's dtype/contiguity/pointer in fp8blk._arrays:
    ``empty(shape, dtype)`` (C-contiguous; BF16 too), ``flat_bytes(arr)`` (flat uint8 view),
    ``window(flat, offset, shape, strides, dtype)`` (a typed view: ``offset`` in bytes,
    ``strides`` in elements), ``copy(dst, src)`` / ``fill(dst, value)`` (in place, on the
    current stream), ``host_view(arr)``, ``device``, ``current_stream_ptr()`` and, on the
    device, ``copies()`` (:class:`Copies`). :func:`ops_for` gives an array's."""

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def flat_bytes(self, arr):
        return arr.reshape(-1).view(U8)

    def window(self, flat, offset, shape, strides, dtype):
        dtype = np.dtype(dtype)
        item = dtype.itemsize
        return np.ndarray(shape, dtype, buffer=flat, offset=offset,
                          strides=tuple(s * item for s in strides))

    def copy(self, dst, src):
        dst[...] = src

    def fill(self, dst, value):
        dst[...] = value

    def host_view(self, arr):
        return arr

    def nbytes(self, arr):
        return arr.nbytes

    def current_stream_ptr(self):
        return None  # host arrays: no stream


class CupyOps(NumpyOps, _arrays.CupyFamily):
    device = True

    def __init__(self):
        import cupy

        self.cupy = cupy
        self._as_strided = cupy.lib.stride_tricks.as_strided

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        if dtype == _arrays.BF16:
            dtype = np.dtype(np.uint16)  # CuPy holds bf16 as bit patterns
        return self.cupy.empty(shape, dtype)

    def window(self, flat, offset, shape, strides, dtype):
        dtype = np.dtype(dtype)
        if dtype == _arrays.BF16:
            dtype = np.dtype(np.uint16)
        item = dtype.itemsize
        typed = flat[offset: offset + _span(shape, strides) * item].view(dtype)
        return self._as_strided(typed, tuple(shape), tuple(s * item for s in strides))

    def current_stream_ptr(self):
        return self.cupy.cuda.get_current_stream().ptr

    def copies(self):
        return cuda_copies()


class TorchOps(_arrays.TorchFamily):

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device.type == "cuda"
        self.where = device

    def tdtype(self, dtype):
        if isinstance(dtype, self.torch.dtype):
            return dtype
        if np.dtype(dtype) == np.uint16:  # bf16 bit patterns: the same 2 bytes as int16
            return self.torch.int16
        return _arrays.numpy_to_torch_dtype(dtype)

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=self.tdtype(dtype), device=self.where)

    def flat_bytes(self, arr):
        flat = arr.reshape(-1)
        if flat.numel() <= 1 and flat.stride(0) != 1:  # DLPack may give size-0/1 tensors
            flat = flat.as_strided((flat.numel(),), (1,))  # any stride; view() needs 1
        return flat.view(self.torch.uint8)

    def window(self, flat, offset, shape, strides, dtype):
        tdtype = self.tdtype(dtype)
        item = tdtype.itemsize
        typed = flat[offset: offset + _span(shape, strides) * item].view(tdtype)
        return typed.as_strided(tuple(shape), tuple(strides), typed.storage_offset())

    def copy(self, dst, src):
        dst.copy_(src)

    def fill(self, dst, value):
        dst.fill_(value)

    def host_view(self, arr):
        return arr.numpy()  # a CPU tensor's memory

    def nbytes(self, arr):
        return arr.numel() * arr.element_size()

    def current_stream_ptr(self):
        if not self.device:
            return None
        return _arrays.torch_stream_ptr(self.where.index)

    def copies(self):
        return cuda_copies()
_NUMPY = NumpyOps()
_cupy_ops = None
_torch_ops = {}


def internal_ops(device):
    """The operations on internal arrays: CuPy for device data, NumPy for host data."""
    global _cupy_ops
    if not device:
        return _NUMPY
    if _cupy_ops is None:
        _cupy_ops = CupyOps()
    return _cupy_ops


def ops_for(arr):
    """The operations object of ``arr``'s family (NumPy, CuPy, torch on its device)."""
    global _cupy_ops
    if isinstance(arr, np.ndarray):
        return _NUMPY
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(arr, cupy.ndarray):
        if _cupy_ops is None:
            _cupy_ops = CupyOps()
        return _cupy_ops
    device = arr.device
    ops = _torch_ops.get(device)
    if ops is None:
        ops = _torch_ops[device] = TorchOps(device)
    return ops


def local_x2d(x, m, k, rows):
    """The local (rows, K) high-precision array as the quantize backend takes it (``x``: the
    C-contiguous input of m * K elements; rows > m: MXFP8 rowwise pads with zero rows up to a
    multiple of 32, never sent)."""
    if type(x) is not np.ndarray and _arrays.is_torch(x) and not x.is_cuda:
        x = _arrays.to_backend(x)[0]  # a CPU tensor: its NumPy view (no copy)
    x2d = x if x.ndim == 2 else x.reshape(m, k)
    if rows != m:
        if ops_for(x2d).name == _arrays.TORCH:
            padded = x2d.new_zeros((rows, k))
        else:
            padded = (np if isinstance(x2d, np.ndarray) else _arrays.cupy_module()).zeros(
                (rows, k), dtype=x2d.dtype)
        padded[:m] = x2d
        x2d = padded
    return x2d


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
            if stream is None:  # the common case: no torch Stream objects made
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
