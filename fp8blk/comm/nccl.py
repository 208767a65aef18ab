"""NCCLComm: the Communicator protocol over NCCL (``cupy.cuda.nccl``), for CuPy arrays.

One rank per GPU. ``NCCLComm.from_mpi(mpi_comm)`` picks the GPU from the rank's position on
its node, broadcasts NCCL's unique id over MPI and keeps the MPI communicator for host data:
NumPy buffers (metadata, layout checks) go through MPI, CuPy buffers through NCCL.

Stream semantics (as torch's NCCL process groups): every collective is enqueued on the
caller's *current* CuPy stream. A synchronous call returns once the work is enqueued; later
work on that stream is ordered after it, and reading the result on the host needs a stream
synchronize (``cupy.asnumpy`` does one). With ``async_op=True`` the returned Handle's
``wait()`` makes the then-current stream wait for the collective (an event) and runs any
post-processing there. To overlap communication with compute, issue the collective while a
separate stream is current.

``op="max"`` on floats is NCCL's fmaxf (NaN-ignoring), the semantics every fp8blk backend has.
Calls inside ``with comm.group():`` are fused into one NCCL group launch; uneven
``all_gather_v`` is one group of broadcasts, one per rank, with no padding.

GPU test (the lead runs it on the H200; Open MPI there needs the flags)::

    /usr/bin/mpiexec --allow-run-as-root --oversubscribe -n 1 \\
        python3 -m mpi4py -m tests.comm.scripts.comm_suite nccl
    python3 -m pytest -m gpu tests/comm -q
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import _arrays
from .base import Communicator, Handle, torch_gather_out

_F16 = np.dtype(np.float16)


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _cupy():
    import cupy

    return cupy


def _nccl_dtype(dtype):
    nccl = _nccl()
    table = {np.dtype(np.uint8): nccl.NCCL_UINT8, np.dtype(np.int32): nccl.NCCL_INT32,
             np.dtype(np.int64): nccl.NCCL_INT64, _F16: nccl.NCCL_FLOAT16,
             np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
             _arrays.BF16: getattr(nccl, "NCCL_BFLOAT16", 9)}  # ncclBfloat16 == 9
    return table[np.dtype(dtype)]


def _ptr(arr):
    """Device address of a CuPy array or a torch CUDA tensor."""
    data_ptr = getattr(arr, "data_ptr", None)  # torch
    return data_ptr() if data_ptr is not None else arr.data.ptr


def _host_array(arr):
    """True for NumPy arrays and torch CPU tensors."""
    return isinstance(arr, np.ndarray) or not getattr(arr, "is_cuda", True)


def _direct_pair(inp, out, size):
    """(nbytes, in ptr, out ptr, stream ptr, result) for an all_gather that needs no
    conversion: both CuPy arrays or both torch CUDA tensors, contiguous, same dtype, out of
    shape (size * n, ...) (allocated when None). None: take the general path."""
    torch = _arrays.torch_module()
    if torch is not None and type(inp) is torch.Tensor:
        out = torch_gather_out(torch, inp, out, size) if inp.is_cuda else None
        if out is None:
            return None
        stream = _arrays.torch_raw_stream()(inp.device.index)
        return (inp.numel() * inp.element_size(), inp.data_ptr(), out.data_ptr(), stream, out)
    cupy = _arrays.cupy_module()
    if cupy is None or type(inp) is not cupy.ndarray or inp.ndim == 0 \
            or not inp.flags.c_contiguous:
        return None
    shape = (size * inp.shape[0],) + inp.shape[1:]
    if out is None:
        out = cupy.empty(shape, dtype=inp.dtype)
    elif (type(out) is not cupy.ndarray or out.dtype != inp.dtype or out.shape != shape
          or not out.flags.c_contiguous):
        return None
    return (inp.nbytes, inp.data.ptr, out.data.ptr, cupy.cuda.get_current_stream().ptr, out)


def _nccl_op(op):
    nccl = _nccl()
    return nccl.NCCL_SUM if op == "sum" else nccl.NCCL_MAX


class NCCLComm(Communicator):
    """Collectives over an NCCL communicator; build it with :meth:`from_mpi`.

    ``nccl_comm``: a ``cupy.cuda.nccl.NcclCommunicator``; ``host_comm``: an MPIComm for host
    (NumPy) buffers, or None to stage host buffers through the device.
    """

    def __init__(self, nccl_comm, rank, size, host_comm=None, device=None):
        super().__init__()
        self.nccl_comm = nccl_comm
        self.rank, self.size = int(rank), int(size)
        self.device = device
        self.host_comm = host_comm

    @classmethod
    def from_mpi(cls, mpi_comm=None, device=None):
        """NCCLComm over the ranks of ``mpi_comm`` (default ``MPI.COMM_WORLD``).

        ``device``: the GPU of this rank; default: the rank's index among the ranks on its
        node (one rank per GPU; more ranks on a node than GPUs raise ValueError). That GPU is
        made current.
        """
        from mpi4py import MPI

        from .mpi import MPIComm

        cupy, nccl = _cupy(), _nccl()
        mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if device is None:
            local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
            local_rank, local_size = local.Get_rank(), local.Get_size()
            local.Free()
            count = cupy.cuda.runtime.getDeviceCount()
            if local_size > count:
                raise ValueError(f"NCCLComm needs one rank per GPU: {local_size} ranks on "
                                 f"this node but {count} GPU(s); start fewer ranks or pass "
                                 f"device=")
            device = local_rank
        cupy.cuda.Device(int(device)).use()
        uid = nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        nccl_comm = nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())
        host = MPIComm(mpi_comm)
        comm = cls(nccl_comm, mpi_comm.Get_rank(), mpi_comm.Get_size(), host_comm=host,
                   device=int(device))
        host.stats = comm.stats  # host traffic counts as this communicator's
        return comm

    # -- the small-message fast path -------------------------------------------------------------
    def all_gather(self, inp, out=None, async_op=False):
        """As :meth:`Communicator.all_gather`. Synchronous calls on contiguous device arrays
        (CuPy, or torch CUDA tensors, passed by pointer: no DLPack) go straight to
        ncclAllGather on the current stream of their family, so the per-call cost is close to
        raw NCCL; everything else takes the general path."""
        if not async_op:
            direct = _direct_pair(inp, out, self.size)
            if direct is not None:
                nbytes, in_ptr, out_ptr, stream, result = direct
                self.stats.record("all_gather", nbytes)
                if nbytes:
                    self.nccl_comm.allGather(in_ptr, out_ptr, nbytes, _nccl().NCCL_UINT8,
                                             stream)
                return result
        return super().all_gather(inp, out, async_op)

    # -- helpers ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def group(self):
        """Fuse the collectives issued inside into one NCCL launch (ncclGroupStart/End)."""
        nccl = _nccl()
        nccl.groupStart()
        try:
            yield self
        finally:
            nccl.groupEnd()

    @staticmethod
    def _stream():
        return _cupy().cuda.get_current_stream()

    def _enqueued(self, async_op, post=None):
        """Handle for work just enqueued on the current stream."""
        if not async_op:
            if post is not None:
                post()
            return Handle.completed()
        event = _cupy().cuda.Event(disable_timing=True)
        event.record(self._stream())

        def wait():
            self._stream().wait_event(event)
        return Handle(waiter=wait, post=post)

    def _host(self, *arrays):
        """True when these are host arrays (served by the MPI host communicator)."""
        host = [not _arrays.is_device(a) for a in arrays]
        if any(host) and not all(host):
            raise TypeError("NCCLComm: pass all buffers of a collective on the device (CuPy) "
                            "or all on the host (NumPy)")
        if host[0] and self.host_comm is None:
            raise TypeError("NCCLComm without a host communicator takes CuPy arrays only: "
                            "build it with NCCLComm.from_mpi to use NumPy buffers too")
        return host[0]

    def _all_gather_v_wire_bytes(self, byte_counts):
        return byte_counts[self.rank]

    # -- hooks --------------------------------------------------------------------------------
    # Empty buffers skip NCCL (a zero-size CuPy array has a null pointer); the ranks agree on
    # the sizes, so every rank skips the same call.
    def _all_reduce(self, buf, dtype, op, async_op):
        if self._host(buf):
            return self.host_comm._all_reduce(buf, dtype, op, async_op)
        if buf.size == 0:
            return self._enqueued(async_op)
        ptr = buf.data.ptr
        self.nccl_comm.allReduce(ptr, ptr, buf.size, _nccl_dtype(dtype), _nccl_op(op),
                                 self._stream().ptr)
        return self._enqueued(async_op)

    def _all_gather(self, inp, out, async_op):
        if self._host(inp, out):
            return self.host_comm._all_gather(inp, out, async_op)
        if out.size == 0:
            return self._enqueued(async_op)
        self.nccl_comm.allGather(inp.data.ptr, out.data.ptr, inp.size, _nccl().NCCL_UINT8,
                                 self._stream().ptr)
        return self._enqueued(async_op)

    def _all_gather_v(self, inp, byte_counts, out, async_op):
        if self._host(inp, out):
            return self.host_comm._all_gather_v(inp, byte_counts, out, async_op)
        if all(c == byte_counts[0] for c in byte_counts):
            return self._all_gather(inp, out, async_op)
        stream = self._stream().ptr
        offset = 0
        with self.group():
            for root, count in enumerate(byte_counts):
                if count:  # every rank skips the same roots: counts agree
                    dst = out.data.ptr + offset
                    src = inp.data.ptr if root == self.rank else dst
                    self.nccl_comm.broadcast(src, dst, count, _nccl().NCCL_UINT8, root, stream)
                offset += count
        return self._enqueued(async_op)

    def _reduce_scatter(self, inp, out, dtype, op, async_op):
        if self._host(inp, out):
            return self.host_comm._reduce_scatter(inp, out, dtype, op, async_op)
        if inp.size == 0:
            return self._enqueued(async_op)
        self.nccl_comm.reduceScatter(inp.data.ptr, out.data.ptr, out.size, _nccl_dtype(dtype),
                                     _nccl_op(op), self._stream().ptr)
        return self._enqueued(async_op)

    def _broadcast(self, buf, root, async_op):
        if self._host(buf):
            return self.host_comm._broadcast(buf, root, async_op)
        if buf.size == 0:
            return self._enqueued(async_op)
        self.nccl_comm.bcast(buf.data.ptr, buf.size, _nccl().NCCL_UINT8, root,
                             self._stream().ptr)
        return self._enqueued(async_op)

    def _all_to_all_v(self, parts, async_op):
        """All parts in ONE NCCL group of ncclSend/ncclRecv per peer with a non-empty count
        (this rank included: NCCL pairs a send to self with the receive from self), enqueued
        on the current stream. Host parts go to the MPI host communicator."""
        if self._host(parts[0][0], parts[0][2]):
            return self.host_comm._all_to_all_v(parts, async_op)
        nccl = _nccl()
        u8, stream = nccl.NCCL_UINT8, self._stream().ptr
        nccl.groupStart()
        try:
            for send, send_counts, recv, recv_counts in parts:
                send_at = recv_at = 0
                for peer in range(self.size):
                    # zero counts are skipped (an empty CuPy array has a null pointer); both
                    # sides of a pair see the same count, so both skip it
                    if send_counts[peer]:
                        self.nccl_comm.send(send.data.ptr + send_at, send_counts[peer], u8,
                                            peer, stream)
                    if recv_counts[peer]:
                        self.nccl_comm.recv(recv.data.ptr + recv_at, recv_counts[peer], u8,
                                            peer, stream)
                    send_at += send_counts[peer]
                    recv_at += recv_counts[peer]
        finally:
            nccl.groupEnd()
        return self._enqueued(async_op)

    stream_ordered = True

    def gather_parts(self, items, stream_ptr=None):
        """All items in ONE NCCL group on ``stream_ptr`` (default: the current CuPy stream):
        equal counts are an in-place ncclAllGather, unequal ones a broadcast per non-empty
        rank. Device arrays (CuPy or torch CUDA tensors) are passed by pointer: nothing is
        converted. Host items go to the MPI host communicator."""
        return self.gather_parts_issuer(items)(stream_ptr)

    def gather_parts_issuer(self, items):
        """``issue(stream_ptr)`` of ``gather_parts``: the NCCL calls (pointers, counts,
        roots) are worked out here, once; an issue makes only them, in one group."""
        if items and not _arrays.is_device(items[0][1]) and _host_array(items[0][1]):
            return self.host_comm.gather_parts_issuer(items)
        nccl = _nccl()
        calls = self._nccl_gather_calls(items, nccl)

        def issue(stream_ptr=None, keep=items):  # keep: the buffers the pointers point into
            stream = self._stream().ptr if stream_ptr is None else stream_ptr
            nccl.groupStart()
            try:
                for function, args in calls:
                    function(*args, stream)
            finally:
                nccl.groupEnd()
            return None
        return issue

    def _nccl_gather_calls(self, items, nccl):
        """[(NCCL method, its arguments but the stream)] of a grouped gather of ``items``."""
        me, u8, calls = self.rank, nccl.NCCL_UINT8, []
        for send, recv, counts in items:
            recv_ptr = _ptr(recv)
            mine = counts[me]
            send_ptr = recv_ptr + sum(counts[:me]) if send is None else _ptr(send)
            if all(c == mine for c in counts):
                if mine:
                    calls.append((self.nccl_comm.allGather, (send_ptr, recv_ptr, mine, u8)))
                continue
            offset = 0
            for root, count in enumerate(counts):
                if count:  # every rank skips the same roots: counts agree
                    dst = recv_ptr + offset
                    calls.append((self.nccl_comm.broadcast,
                                  (send_ptr if root == me else dst, dst, count, u8, root)))
                offset += count
        return calls

    def _barrier(self):
        self._stream().synchronize()
        if self.host_comm is not None:
            self.host_comm.mpi_comm.Barrier()
            return
        probe = _cupy().zeros(1, dtype=np.float32)
        self.nccl_comm.allReduce(probe.data.ptr, probe.data.ptr, 1, _nccl().NCCL_FLOAT32,
                                 _nccl().NCCL_SUM, self._stream().ptr)
        self._stream().synchronize()
