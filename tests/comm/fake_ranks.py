"""Ranks as threads of one process, for NCCLComm tests without mpiexec: a thread world that
exchanges Python objects, an MPI-like host communicator for the metadata over it, a runner, an
NCCL stand-in on host memory (:class:`FakeNccl`, installed by :func:`host_nccl`), and NumPy
arrays taken for device arrays (:class:`DeviceOps`: the gather's device path, its fix-up's
runtime calls done on host memory by :class:`HostRuntime`). Used by
tests/comm/gather/test_nccl_fake.py, tests/comm/gather/test_fake_ranks_gpu.py (with an NCCL
stand-in between device buffers) and tests/master/scripts/fake_comm.py."""
import ctypes
import threading
import types

import numpy as np

from fp8blk.comm import Communicator, Handle, NCCLComm
from fp8blk.comm.gather.streams import Copies, NumpyOps
from fp8blk.comm import nccl as nccl_module

STREAM = 0x5EED  # the stream handle DeviceOps reports (HostRuntime checks it comes back)


class World:
    """n threads that swap one object each (two barriers: all read before anyone writes
    again). ``call`` names the collective a rank issues (op, counts): ranks that issue
    different ones all raise, as real collectives would hang or mix bytes instead."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots = [None] * n

    def exchange(self, rank, payload, call=None):
        self.slots[rank] = (call, payload)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        calls = [c for c, _ in got]
        if any(c != calls[0] for c in calls):
            raise RuntimeError(f"the ranks issued different collectives: {calls}")
        return [p for _, p in got]


class FakeHost(Communicator):
    """The MPI host communicator: metadata (NumPy int64) through the thread world."""

    def __init__(self, world, rank):
        super().__init__()
        self.world, self.rank, self.size = world, rank, world.n

    def _all_gather(self, inp, out, async_op):
        out[...] = np.concatenate(self.world.exchange(self.rank, inp.copy(),
                                                      ("host all_gather", inp.size)))
        return Handle.completed()

    def _all_reduce(self, buf, dtype, op, async_op):
        assert op == "max"
        got = self.world.exchange(self.rank, buf.copy(), ("host all_reduce", buf.size))
        buf[...] = np.max(np.stack(got), axis=0)
        return Handle.completed()


def run_ranks(n, body, nccl):
    """Run ``body(comm)`` on n thread ranks (NCCLComm over ``nccl(world, rank)``); returns
    (results, comms) and re-raises the first rank's error."""
    world = World(n)
    comms = []
    for r in range(n):
        comm = NCCLComm(nccl(world, r), r, n, host_comm=FakeHost(world, r))
        comm.host_comm.stats = comm.stats
        comms.append(comm)
    return run_threads(n, lambda r: body(comms[r]), world.barrier.abort), comms


def run_threads(n, body, abort, timeout=240.0):
    """``body(rank)`` on n threads; returns the results by rank. A rank that raises calls
    ``abort()`` (breaking the barrier the others wait at); the first error that is not such a
    broken barrier is re-raised (else the first error). The one thread-rank runner of the
    tests (fp8blk.comm's and the master weights')."""
    results, errors = [None] * n, [None] * n

    def run(rank):
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors[rank] = error
            abort()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a thread rank did not finish")
    failed = [e for e in errors if e is not None]
    real = [e for e in failed if not isinstance(e, threading.BrokenBarrierError)]
    if failed:
        raise (real or failed)[0]
    return results


class FakeNccl:
    """The calls NCCLComm makes on a ``cupy.cuda.nccl.NcclCommunicator``, on host memory."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.calls = []

    def allGather(self, send, recv, count, dtype, stream):
        self.calls.append(("allGather", count, send == recv + self.rank * count))
        data = ctypes.string_at(send, count)
        for r, chunk in enumerate(self.world.exchange(self.rank, data, ("allGather", count))):
            ctypes.memmove(recv + r * count, chunk, count)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", count, root))
        data = ctypes.string_at(send, count) if root == self.rank else None
        got = self.world.exchange(self.rank, data, ("broadcast", count, root))
        ctypes.memmove(recv, got[root], count)


def host_nccl(setattr_):
    """Make NCCLComm talk to :class:`FakeNccl` on host memory (``setattr_``: pytest's
    ``monkeypatch.setattr``, or ``setattr`` for good)."""
    fake = types.SimpleNamespace(NCCL_UINT8=0, groupStart=lambda: None, groupEnd=lambda: None)
    setattr_(nccl_module, "_nccl", lambda: fake)
    setattr_(nccl_module, "_host_array", lambda arr: False)  # treat as device
    setattr_(nccl_module, "_ptr", lambda arr: arr.ctypes.data)
    setattr_(NCCLComm, "_stream", staticmethod(lambda: types.SimpleNamespace(ptr=0)))


class HostRuntime:
    """``cupy.cuda.runtime``'s memcpy2DAsync and memsetAsync on host addresses, with the
    argument checks CUDA makes (a width wider than a pitch is cudaErrorInvalidPitchValue), and
    the device-to-host copy and events of the gather's in-band status. Every call completes at
    once; ``ready`` False holds events back (eventQuery answers cudaErrorNotReady until
    eventSynchronize or ``ready`` True), as a device still running the collective would."""

    memcpyDeviceToDevice = 3
    memcpyDeviceToHost = 2
    eventDisableTiming = 2
    NOT_READY = 600  # cudaErrorNotReady

    def __init__(self):
        self.calls = []  # the fix-up's calls (memcpy2D, memset)
        self.status_calls = []  # the status copies and event records
        self.ready = True
        self.events = 0
        self.held = set()

    def memcpyAsync(self, dst, src, size, kind, stream):
        assert kind == 2 and stream == STREAM and size > 0
        self.status_calls.append(("memcpy", size))
        ctypes.memmove(dst, src, size)

    def eventCreateWithFlags(self, flags):
        assert flags == 2
        self.events += 1
        return self.events

    def eventRecord(self, event, stream):
        assert stream == STREAM
        self.status_calls.append(("record", event))
        if not self.ready:
            self.held.add(event)

    def eventQuery(self, event):
        if self.ready:
            self.held.clear()
        return self.NOT_READY if event in self.held else 0

    def eventSynchronize(self, event):
        self.held.discard(event)

    def memcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert kind == 3 and stream == STREAM
        assert 0 < width <= dpitch and width <= spitch and height > 0, (width, dpitch, spitch)
        self.calls.append(("memcpy2D", width, height))
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def memsetAsync(self, ptr, value, size, stream):
        assert stream == STREAM and 0 <= value < 256 and size > 0
        self.calls.append(("memset", value, size))
        ctypes.memset(ptr, value, size)


class DeviceOps(NumpyOps):
    """NumPy arrays taken for device arrays: the gather takes its device path on them (the
    fix-up's runtime calls, no views per call), on the stream handle ``STREAM``."""

    device = True

    def __init__(self):
        self.runtime = HostRuntime()

    def current_stream_ptr(self):
        return STREAM

    def copies(self):
        return Copies(self.runtime)
