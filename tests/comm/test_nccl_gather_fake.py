"""NCCLComm's grouped gather (in-place ncclAllGather for equal shards, a group of broadcasts
for unequal ones) without a GPU: ranks are threads, NCCL is a stand-in that moves bytes
between host addresses with the same calls and arguments (pointers, byte counts, roots), and
the gather runs on NumPy arrays. It checks what the H200 cannot show cheaply: the offsets,
counts and in-place slots the gather hands to NCCL, on equal, unequal and empty shards."""
import ctypes
import threading
import types
import warnings

import numpy as np
import pytest

import fp8blk as fb
from fp8blk.comm import Communicator, GatherFallbackWarning, Handle, NCCLComm
from fp8blk.comm import nccl as nccl_module
from fp8blk.comm.gather import gather_along_first_dim, plan_cache


class World:
    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots = [None] * n

    def exchange(self, rank, payload):
        self.slots[rank] = payload
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class FakeNccl:
    """The calls NCCLComm makes on a ``cupy.cuda.nccl.NcclCommunicator``, on host memory."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.calls = []

    def allGather(self, send, recv, count, dtype, stream):
        self.calls.append(("allGather", count, send == recv + self.rank * count))
        data = ctypes.string_at(send, count)
        for r, chunk in enumerate(self.world.exchange(self.rank, data)):
            ctypes.memmove(recv + r * count, chunk, count)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", count, root))
        data = ctypes.string_at(send, count) if root == self.rank else None
        ctypes.memmove(recv, self.world.exchange(self.rank, data)[root], count)


class FakeHost(Communicator):
    """The MPI host communicator: metadata (NumPy int64) through the thread world."""

    def __init__(self, world, rank):
        super().__init__()
        self.world, self.rank, self.size = world, rank, world.n

    def _all_gather(self, inp, out, async_op):
        out[...] = np.concatenate(self.world.exchange(self.rank, inp.copy()))
        return Handle.completed()

    def _all_reduce(self, buf, dtype, op, async_op):
        assert op == "max"
        buf[...] = np.max(np.stack(self.world.exchange(self.rank, buf.copy())), axis=0)
        return Handle.completed()


@pytest.fixture
def fake_nccl(monkeypatch):
    fake = types.SimpleNamespace(NCCL_UINT8=0, groupStart=lambda: None, groupEnd=lambda: None)
    monkeypatch.setattr(nccl_module, "_nccl", lambda: fake)
    monkeypatch.setattr(nccl_module, "_host_array", lambda arr: False)  # treat as device
    monkeypatch.setattr(nccl_module, "_ptr", lambda arr: arr.ctypes.data)
    monkeypatch.setattr(NCCLComm, "_stream", staticmethod(
        lambda: types.SimpleNamespace(ptr=0)))


def _run_ranks(n, body):
    world = World(n)
    comms = []
    for r in range(n):
        comm = NCCLComm(FakeNccl(world, r), r, n, host_comm=FakeHost(world, r))
        comm.host_comm.stats = comm.stats
        comms.append(comm)
    results, errors = [None] * n, []

    def run(r):
        try:
            results[r] = body(comms[r])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append((r, error))
            world.barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0][1]
    return results, comms


def _data(rng, rows, k):
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-4, 4, (rows, 1))
    return x.astype(np.float32)


def _same(got, expected):
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                 "columnwise_scale_inv"):
        g, e = getattr(got, name), getattr(expected, name)
        assert (g is None) == (e is None), name
        if e is not None:
            assert g.shape == e.shape and np.array_equal(g.view(np.uint8), e.view(np.uint8)), \
                name


CASES = [(fb.Block1D(), True, False), (fb.Block1D(), True, True), (fb.Block1D(), False, True),
         (fb.Block2D(), True, True), (fb.MXFP8(), True, False), (fb.MXFP8(), True, True)]


@pytest.mark.parametrize("recipe,rowwise,columnwise", CASES)
@pytest.mark.parametrize("n", [2, 3])
def test_nccl_grouped_gather_bytes(fake_nccl, recipe, rowwise, columnwise, n, rng):
    mx = isinstance(recipe, fb.MXFP8)
    k = 96 if mx else 300
    unit = 32 if mx else 128
    splits = [[unit] * n, [unit * 2] + [unit] * (n - 1), [0] + [unit] * (n - 1),
              [unit] * (n - 1) + [unit // 2 if not mx or not columnwise else 0]]
    if not mx:
        splits.append([5] * n)  # equal but unaligned (Block1D rowwise stays fast)
    for rows in splits:
        if mx and sum(rows) % 32:
            continue
        every = [_data(rng, r, k) for r in rows]
        expected = fb.quantize(np.concatenate(every), recipe, rowwise, columnwise)

        def body(comm, rows=rows, every=every):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GatherFallbackWarning)
                out, _ = gather_along_first_dim(every[comm.rank], comm, recipe, rowwise,
                                                columnwise, sizes=rows)
                again, _ = gather_along_first_dim(every[comm.rank], comm, recipe, rowwise,
                                                  columnwise, sizes=rows, out=out)
            assert again is out
            return out, comm.stats.last_gather_path
        results, comms = _run_ranks(n, body)
        for (out, path), comm in zip(results, comms):
            _same(out, expected)
            calls = comm.nccl_comm.calls
            if path == "fast" and len(set(rows)) == 1:
                # equal shards: every collective an in-place allGather
                assert calls and all(c[0] == "allGather" for c in calls), calls
                assert any(c[2] for c in calls), calls  # the data went in place


def test_nccl_plain_and_cache(fake_nccl, rng):
    lengths = [3, 0, 5]
    every = [rng.integers(0, 100, n).astype(np.int64) for n in lengths]

    def body(comm):
        out, _ = gather_along_first_dim(every[comm.rank], comm)
        meta = comm.stats.meta_calls
        x = _data(np.random.default_rng(comm.rank), 64, 256)
        gather_along_first_dim(x, comm, fb.Block1D())
        gather_along_first_dim(x, comm, fb.Block1D())
        cache = plan_cache(comm)
        return out, meta, cache.hits, cache.misses
    results, _ = _run_ranks(3, body)
    for out, meta, hits, misses in results:
        assert np.array_equal(out, np.concatenate(every))
        assert meta == 2  # the check, then the exchange of a first call
        assert (hits, misses) == (1, 2)


TORCH_CASES = [(fb.Block1D(), True, False), (fb.Block1D(), True, True),
               (fb.MXFP8(), True, True), (fb.Block2D(), True, False)]


@pytest.mark.parametrize("recipe,rowwise,columnwise", TORCH_CASES)
def test_torch_native_arrays(fake_nccl, monkeypatch, recipe, rowwise, columnwise, rng):
    """The path torch CUDA inputs take (torch output buffers, torch windows and strided
    copies, pointers from data_ptr), run on CPU tensors standing in for CUDA ones."""
    torch = pytest.importorskip("torch")
    from fp8blk.comm import _native, gather as gather_module

    monkeypatch.setattr(gather_module, "_internal_ops", lambda src: _native.ops_for(src.x))
    monkeypatch.setattr(nccl_module, "_ptr", lambda arr: arr.data_ptr()
                        if isinstance(arr, torch.Tensor) else arr.ctypes.data)
    n, k = 3, 96 if isinstance(recipe, fb.MXFP8) else 260
    for rows in ([128] * n, [256, 128, 96 if not isinstance(recipe, fb.Block2D) else 0]):
        every = [_data(rng, r, k) for r in rows]
        expected = fb.quantize(np.concatenate(every), recipe, rowwise, columnwise)

        def body(comm, every=every):
            out, _ = gather_along_first_dim(torch.from_numpy(every[comm.rank]), comm, recipe,
                                            rowwise, columnwise)
            return out
        results, _ = _run_ranks(n, body)
        for out in results:
            for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                         "columnwise_scale_inv"):
                g, e = getattr(out, name), getattr(expected, name)
                assert (g is None) == (e is None), name
                if e is not None:
                    assert isinstance(g, torch.Tensor)
                    assert np.array_equal(g.numpy().view(np.uint8), e.view(np.uint8)), name
