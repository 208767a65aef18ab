"""MPIComm: the Communicator protocol over an mpi4py communicator.

Host (NumPy) buffers go to MPI directly. CuPy buffers are staged through host memory (copy to
the host after the caller's current stream, collective, copy back on that stream), unless the
MPI library reports CUDA awareness (``MPIX_Query_cuda_support``; override with
``cuda_aware=`` or the environment variable ``FP8BLK_MPI_CUDA_AWARE=0|1``), in which case
byte-moving collectives and plain integer/fp32 reductions take device pointers after a stream
synchronize. The Open MPI of the lent GPU machine is not CUDA-aware (a device buffer would
segfault there), so staging is what runs there.

MPI has no bfloat16/float16 types: their SUM uses a user-defined operation on 16-bit words
(each pairwise add is done in fp32 and rounded once, as NCCL does). Floating-point MAX runs as
integer MAX over order-preserving keys, which ignores NaN as ``fmaxf`` does
(see :func:`fp8blk.comm.base.float_to_max_keys`).

Run multi-rank programs as ``mpiexec -n 4 python -m mpi4py script.py``: with ``-m mpi4py`` an
uncaught exception on one rank aborts the whole job instead of leaving the others blocked in a
collective.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from .. import _arrays
from .base import Communicator, Handle, float_to_max_keys, is_float, max_keys_to_float

_F16 = np.dtype(np.float16)


def _mpi():
    from mpi4py import MPI

    return MPI


def query_cuda_aware() -> bool:
    """True when the loaded MPI library says it accepts device pointers. The environment
    variable FP8BLK_MPI_CUDA_AWARE=0|1 overrides the query."""
    env = os.environ.get("FP8BLK_MPI_CUDA_AWARE")
    if env is not None:
        return env.strip() == "1"
    try:
        # dlsym through mpi4py's extension module also searches the libmpi it links.
        query = ctypes.CDLL(_mpi().__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


_half_sum_ops = {}


def _half_sum_op(dtype):
    """MPI user op: element-wise sum of float16 / bfloat16 words (fp32 add, one rounding)."""
    op = _half_sum_ops.get(dtype)
    if op is None:
        def add(inbuf, inoutbuf, datatype, dtype=dtype):
            acc = np.frombuffer(inoutbuf, dtype=dtype)
            np.add(np.frombuffer(inbuf, dtype=dtype), acc, out=acc)

        op = _half_sum_ops[dtype] = _mpi().Op.Create(add, commute=True)
    return op


def _wire_op(dtype, op):
    """(dtype the buffer travels as, MPI op) of a SUM or MAX that needs no key transform
    (float MAX goes through max keys): fp16/bf16 SUM as uint16 words with a user op, the
    rest as themselves."""
    MPI = _mpi()
    if dtype in (_F16, _arrays.BF16):
        return np.uint16, _half_sum_op(dtype)
    return dtype, MPI.SUM if op == "sum" else MPI.MAX


def _mpi_type(dtype):
    MPI = _mpi()
    table = {np.dtype(np.uint8): MPI.UINT8_T, np.dtype(np.int16): MPI.INT16_T,
             np.dtype(np.uint16): MPI.UINT16_T, np.dtype(np.int32): MPI.INT32_T,
             np.dtype(np.int64): MPI.INT64_T, np.dtype(np.float32): MPI.FLOAT,
             np.dtype(np.float64): MPI.DOUBLE}
    return table[np.dtype(dtype)]


def _current_stream():
    import cupy

    return cupy.cuda.get_current_stream()


def _to_host(arr):
    """Host copy of a CuPy array after the work queued on the current stream (blocking)."""
    return arr.get(stream=_current_stream())


def _to_device(host, dev):
    """Copy a host array into a CuPy array on the current stream."""
    dev.set(host.reshape(dev.shape), stream=_current_stream())


class MPIComm(Communicator):
    """Collectives over ``mpi_comm`` (an ``mpi4py.MPI.Comm``; default ``MPI.COMM_WORLD``)."""

    def __init__(self, mpi_comm=None, cuda_aware=None):
        super().__init__()
        MPI = _mpi()
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD
        if not isinstance(mpi_comm, MPI.Comm):
            raise TypeError(f"MPIComm takes an mpi4py.MPI.Comm (e.g. MPI.COMM_WORLD), got "
                            f"{type(mpi_comm).__name__}")
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.cuda_aware = query_cuda_aware() if cuda_aware is None else bool(cuda_aware)

    # -- helpers ------------------------------------------------------------------------------
    def _direct(self, arr) -> bool:
        """May this array go to MPI as is (host, or device with a CUDA-aware MPI)?"""
        if not _arrays.is_device(arr):
            return True
        if self.cuda_aware:
            _current_stream().synchronize()
            return True
        return False

    def _all_gather_v_wire_bytes(self, byte_counts):
        return byte_counts[self.rank]

    @staticmethod
    def _request(request, post):
        return Handle(waiter=request.Wait, post=post)

    # -- hooks --------------------------------------------------------------------------------
    def _all_reduce(self, buf, dtype, op, async_op):
        MPI = _mpi()
        device = _arrays.is_device(buf)
        transform = is_float(dtype) and op == "max"
        half = dtype in (_F16, _arrays.BF16)
        if device and not (transform or half) and self._direct(buf):
            host = buf
        else:
            host = _to_host(buf) if device else buf
        if transform:
            work = float_to_max_keys(host, dtype)
            mpi_op = MPI.MAX
        else:
            wire, mpi_op = _wire_op(dtype, op)
            work = host.view(wire)
        message = [work, _mpi_type(work.dtype)]

        def post():
            if transform:
                max_keys_to_float(work)
            if host is not buf:
                _to_device(host, buf)
        if async_op:
            return self._request(self.mpi_comm.Iallreduce(MPI.IN_PLACE, message, mpi_op), post)
        self.mpi_comm.Allreduce(MPI.IN_PLACE, message, mpi_op)
        post()
        return Handle.completed()

    def _all_gather(self, inp, out, async_op):
        MPI = _mpi()
        send = inp if self._direct(inp) else _to_host(inp)
        recv = out if self._direct(out) else np.empty(out.size, np.uint8)

        def post():
            if recv is not out:
                _to_device(recv, out)
        if async_op:
            request = self.mpi_comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
            return self._request(request, post)
        self.mpi_comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
        post()
        return Handle.completed()

    def _all_gather_v(self, inp, byte_counts, out, async_op):
        MPI = _mpi()
        send = inp if self._direct(inp) else _to_host(inp)
        recv = out if self._direct(out) else np.empty(out.size, np.uint8)
        displacements = np.concatenate([[0], np.cumsum(byte_counts[:-1])]).astype(np.int64)
        counts = np.asarray(byte_counts, dtype=np.int64)
        spec = [recv, (counts, displacements), MPI.BYTE]

        def post():
            if recv is not out:
                _to_device(recv, out)
        if async_op:
            return self._request(self.mpi_comm.Iallgatherv([send, MPI.BYTE], spec), post)
        self.mpi_comm.Allgatherv([send, MPI.BYTE], spec)
        post()
        return Handle.completed()

    def _reduce_scatter(self, inp, out, dtype, op, async_op):
        MPI = _mpi()
        transform = is_float(dtype) and op == "max"
        half = dtype in (_F16, _arrays.BF16)
        device = _arrays.is_device(inp)
        if device and not (transform or half) and self._direct(inp):
            send, recv = inp, out
        else:
            send = _to_host(inp) if device else inp
            recv = np.empty(out.shape, dtype=out.dtype) if device else out
        if transform:
            send = float_to_max_keys(np.array(send, copy=True), dtype)  # inputs stay intact
            recv_work = recv.view(send.dtype)
            mpi_op = MPI.MAX
        else:
            wire, mpi_op = _wire_op(dtype, op)
            send, recv_work = send.view(wire), recv.view(wire)
        mpi_type = _mpi_type(send.dtype)

        def post():
            if transform:
                max_keys_to_float(recv_work)
            if recv is not out:
                _to_device(recv, out)
        if async_op:
            request = self.mpi_comm.Ireduce_scatter_block([send, mpi_type],
                                                          [recv_work, mpi_type], mpi_op)
            return self._request(request, post)
        self.mpi_comm.Reduce_scatter_block([send, mpi_type], [recv_work, mpi_type], mpi_op)
        post()
        return Handle.completed()

    def _broadcast(self, buf, root, async_op):
        MPI = _mpi()
        host = buf if self._direct(buf) else _to_host(buf)

        def post():
            if host is not buf:
                _to_device(host, buf)
        if async_op:
            return self._request(self.mpi_comm.Ibcast([host, MPI.BYTE], root=root), post)
        self.mpi_comm.Bcast([host, MPI.BYTE], root=root)
        post()
        return Handle.completed()

    def gather_parts(self, items, stream_ptr=None):
        """Each item is one non-blocking Allgather(v) (MPI_IN_PLACE where this rank's bytes
        are already in place); device (CuPy) buffers are staged through host memory unless
        the MPI is CUDA-aware. Returns the ``finish()`` that waits for all of them."""
        MPI = _mpi()
        requests, copies = [], []
        for send, recv, counts in items:
            recv = _arrays.to_backend(recv)[0]
            send = None if send is None else _arrays.to_backend(send)[0]
            start = sum(counts[: self.rank])
            mine = counts[self.rank]
            if self._direct(recv):
                host_recv = recv
            else:
                host_recv = np.empty(recv.size, np.uint8)
                copies.append((host_recv, recv))
                if send is None:  # in place: this rank's bytes go to MPI from the host copy
                    host_recv[start: start + mine] = _to_host(recv[start: start + mine])
            if send is not None and not self._direct(send):
                send = _to_host(send)
            send_spec = MPI.IN_PLACE if send is None else [send, MPI.BYTE]
            if all(c == mine for c in counts):
                requests.append(self.mpi_comm.Iallgather(send_spec, [host_recv, MPI.BYTE]))
            else:
                displacements = np.cumsum([0] + list(counts[:-1]), dtype=np.int64)
                spec = [host_recv, (np.asarray(counts, np.int64), displacements), MPI.BYTE]
                requests.append(self.mpi_comm.Iallgatherv(send_spec, spec))

        def finish():
            MPI.Request.Waitall(requests)
            for host, dev in copies:
                _to_device(host, dev)
        return finish

    def _all_to_all_v(self, parts, async_op):
        """One non-blocking Alltoallv per part; device (CuPy) buffers are staged through host
        memory unless the MPI is CUDA-aware."""
        MPI = _mpi()
        requests, copies = [], []
        for send, send_counts, recv, recv_counts in parts:
            host_send = send if self._direct(send) else _to_host(send)
            host_recv = recv if self._direct(recv) else np.empty(recv.size, np.uint8)
            if host_recv is not recv:
                copies.append((host_recv, recv))
            requests.append(self.mpi_comm.Ialltoallv(_v_spec(host_send, send_counts),
                                                     _v_spec(host_recv, recv_counts)))

        def post(keep=parts):  # keep: the send buffers live until the requests are done
            for host, dev in copies:
                _to_device(host, dev)
        if async_op:
            return Handle(waiter=lambda: MPI.Request.Waitall(requests), post=post)
        MPI.Request.Waitall(requests)
        post()
        return Handle.completed()

    def _barrier(self):
        if "cupy" in sys.modules:  # device work queued before the barrier counts as before it
            try:
                _current_stream().synchronize()
            except Exception:  # CuPy without a usable device: nothing can be queued
                pass
        self.mpi_comm.Barrier()


def _v_spec(buf, counts):
    """[buffer, (counts, displacements), BYTE] of a vector collective, peer by peer."""
    counts = np.asarray(counts, dtype=np.int64)
    displacements = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
    return [buf, (counts, displacements), _mpi().BYTE]
