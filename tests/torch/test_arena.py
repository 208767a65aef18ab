"""fp8blk/torch/_arena.py: the per-stream scratch memory of the Linear's lean hot path. Its
bookkeeping runs on CPU tensors here; tests/torch/linear/test_plans.py checks the lean path's
bytes, allocations and streams on the GPU."""
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import _arena, release_scratch, scratch_bytes  # noqa: E402

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh():
    release_scratch()
    yield
    release_scratch()


def test_reserve_grows_only_when_a_call_needs_more():
    arena = _arena.for_stream(0, 0)
    base = arena.reserve(100, "cpu")
    assert arena.nbytes == 2 * MIB and scratch_bytes() == 2 * MIB
    assert arena.reserve(2 * MIB, "cpu") == base          # fits: the same memory
    arena.reserve(2 * MIB + 1, "cpu")                     # grows, in 2 MiB steps
    assert arena.nbytes == 4 * MIB and scratch_bytes() == 4 * MIB
    assert arena.buffer.numel() == 4 * MIB and arena.ptr == arena.buffer.data_ptr()
    assert arena.reserve(10, "cpu") == arena.ptr          # never shrinks


def test_one_arena_per_device_and_stream():
    a, b, c = _arena.for_stream(0, 0), _arena.for_stream(1, 0), _arena.for_stream(0, 77)
    assert len({id(a), id(b), id(c)}) == 3 and _arena.for_stream(0, 77) is c
    for arena in (a, b, c):
        arena.reserve(1, "cpu")
    assert scratch_bytes() == 3 * 2 * MIB
    release_scratch()
    assert scratch_bytes() == 0 and (a.buffer, a.ptr, a.nbytes) == (None, 0, 0)
    assert _arena.reserve(0, 0, 10, "cpu") == a.buffer.data_ptr()   # grows again on use


def test_reserve_is_for_stream_then_reserve():
    base = _arena.reserve(3, 9, 100, "cpu")
    arena = _arena.for_stream(3, 9)
    assert base == arena.ptr and arena.nbytes == 2 * MIB
    assert _arena.reserve(3, 9, 2 * MIB, "cpu") == base          # the fast path: no growth
    assert _arena.reserve(3, 9, 2 * MIB + 1, "cpu") == arena.ptr and arena.nbytes == 4 * MIB


def test_one_arena_per_thread():
    """Two threads queuing on one stream would interleave their calls' launches over the same
    bytes: each thread has its own arena (autograd's device thread, say)."""
    mine = _arena.for_stream(0, 0)
    other = []
    worker = threading.Thread(target=lambda: other.append(_arena.for_stream(0, 0)))
    worker.start()
    worker.join()
    assert other[0] is not mine and _arena.for_stream(0, 0) is mine


def test_release_frees_every_threads_arenas():
    """release_scratch() from one thread empties the arenas other threads hold (autograd's
    device thread keeps its arena between steps)."""
    done, go = threading.Event(), threading.Event()
    held = []

    def worker():
        held.append(_arena.for_stream(0, 0))
        held[0].reserve(3 * MIB, "cpu")
        done.set()
        go.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    assert done.wait(10)
    _arena.for_stream(0, 0).reserve(1, "cpu")
    assert scratch_bytes() == 4 * MIB + 2 * MIB
    release_scratch()
    assert scratch_bytes() == 0 and held[0].buffer is None
    go.set()
    t.join()


def test_arenas_of_many_streams_stay_bounded():
    for stream in range(40):
        _arena.for_stream(0, stream).reserve(1, "cpu")
    assert scratch_bytes() <= 16 * 2 * MIB


def test_carve_aligns_every_buffer():
    offsets, total = _arena.carve([1000, 0, 3, 256, 17])
    assert offsets == [0, 1024, 1024, 1280, 1536] and total == 1792
    assert all(o % _arena.ALIGN == 0 for o in offsets)
    # no two buffers overlap: each starts at or after the previous one's end
    sizes = [1000, 0, 3, 256, 17]
    assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(sizes) - 1))
    assert offsets[-1] + sizes[-1] <= total


def test_a_grown_arena_drops_the_old_memory():
    arena = _arena.for_stream(0, 5)
    arena.reserve(1, "cpu")
    old = weakref.ref(arena.buffer)
    arena.reserve(3 * MIB, "cpu")
    assert old() is None and arena.nbytes == 4 * MIB
