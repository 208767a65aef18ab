"""NCCLComm's grouped gather (in-place ncclAllGather for equal shards, a group of broadcasts
for unequal ones) without a GPU: ranks are threads, NCCL is a stand-in that moves bytes
between host addresses with the same calls and arguments (pointers, byte counts, roots), and
the gather runs on NumPy arrays. It checks what the H200 cannot show cheaply: the offsets,
counts and in-place slots the gather hands to NCCL, on equal, unequal and empty shards."""
import threading
import warnings

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk.comm import GatherFallbackWarning
from fp8blk.comm import nccl as nccl_module
from fp8blk.comm.gather import gather_along_first_dim, plan_cache
from fp8blk.comm.gather import paths as gather_paths
from fp8blk.comm.gather import plan as gather_plan
from fp8blk.comm.gather import streams as gather_streams

from tests.comm.fake_ranks import DeviceOps, FakeNccl, host_nccl, run_ranks
from tests.comm.gather.checks import assert_same_bytes, gather_input


@pytest.fixture
def fake_nccl(monkeypatch):
    host_nccl(monkeypatch.setattr)


def _run_ranks(n, body):
    return run_ranks(n, body, FakeNccl)


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
        every = [gather_input(rng, r, k) for r in rows]
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
            assert_same_bytes(out, expected)
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
        x = gather_input(np.random.default_rng(comm.rank), 64, 256)
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
    monkeypatch.setattr(gather_paths, "result_ops", lambda src: gather_streams.ops_for(src.x))
    monkeypatch.setattr(nccl_module, "_ptr", lambda arr: arr.data_ptr()
                        if isinstance(arr, torch.Tensor) else arr.ctypes.data)
    n, k = 3, 96 if isinstance(recipe, fb.MXFP8) else 260
    for rows in ([128] * n, [256, 128, 96 if not isinstance(recipe, fb.Block2D) else 0]):
        every = [gather_input(rng, r, k) for r in rows]
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


# --------------------------------------------------------------------------------------------
# The device fix-up (raw cudaMemcpy2DAsync / cudaMemsetAsync calls) on host memory


class CheckedDeviceOps(DeviceOps):
    """Device ops on host memory that count the views they make and refuse view copies."""

    def __init__(self):
        super().__init__()
        self.views = 0

    def window(self, *args):
        self.views += 1
        return super().window(*args)

    def copy(self, dst, src):
        raise AssertionError("the device fix-up copies through the runtime, not views")


_RANK = threading.local()  # the rank of the thread (each rank has its own fake ops)


def _expected_calls(recipe, rowwise, columnwise, rows, k):
    """(memcpy2D calls, memset calls) one fix-up makes."""
    block1d, m = isinstance(recipe, fb.Block1D), sum(rows)
    busy = sum(1 for r in rows if r)
    copies = busy * ((rowwise and block1d) + (columnwise and block1d))
    copies += block1d and rowwise and m % 4 != 0  # the 1.0 padding, from a constant block
    memsets = 0
    if isinstance(recipe, fb.MXFP8):
        memsets += rowwise and m % 128 != 0
        memsets += columnwise and (m // 32) % 4 != 0
    return copies, memsets


@pytest.mark.parametrize("recipe,rowwise,columnwise", CASES)
@pytest.mark.parametrize("n", [2, 3])
def test_device_fix_up_calls(fake_nccl, monkeypatch, recipe, rowwise, columnwise, n, rng):
    """The device fix-up's runtime calls (addresses, pitches, widths) on host memory: bytes
    equal ``quantize`` of the whole for equal, unequal and empty shards and shards that are
    not multiples of 4 rows; one memcpy2D per rank and staged part; the steady state (the same
    out= again) builds no views and repeats the same calls."""
    mx = isinstance(recipe, fb.MXFP8)
    k = 96 if mx else 300
    if mx:
        splits = [[32] * n, [64] + [32] * (n - 1), [0] + [32] * (n - 1)]
        if not columnwise:
            splits.append([7, 25] + [32] * (n - 2))  # padded locally, M % 128 != 0
    elif columnwise or isinstance(recipe, fb.Block2D):  # stay fast: ranks start at 128k
        splits = [[128] * n, [256] + [128] * (n - 1), [0] + [128] * (n - 1),
                  [128] * (n - 1) + [5]]
    else:
        splits = [[5] * n, [6, 0] + [3] * (n - 2), [128, 7] + [1] * (n - 2), [0] * (n - 1) + [9]]
    for rows in splits:
        every = [gather_input(rng, r, k) for r in rows]
        expected = fb.quantize(np.concatenate(every), recipe, rowwise, columnwise)
        ops = [CheckedDeviceOps() for _ in range(n)]
        monkeypatch.setattr(gather_paths, "result_ops", lambda src: ops[_RANK.value])
        fresh = [gather_input(rng, r, k) for r in rows]
        again_expected = fb.quantize(np.concatenate(fresh), recipe, rowwise, columnwise)

        def body(comm, rows=rows, every=every, fresh=fresh):
            _RANK.value = comm.rank
            out, _ = gather_along_first_dim(every[comm.rank], comm, recipe, rowwise,
                                            columnwise, sizes=rows)
            assert_same_bytes(out, expected)
            first = len(ops[comm.rank].runtime.calls)
            views = ops[comm.rank].views
            target = out
            for step in range(3):
                again, _ = gather_along_first_dim(fresh[comm.rank], comm, recipe, rowwise,
                                                  columnwise, sizes=rows, out=target)
                assert again is target
                if step == 0:
                    views = ops[comm.rank].views  # the first call with this out builds them
                    calls = ops[comm.rank].runtime.calls[first:]
            assert ops[comm.rank].views == views, "the steady state made views"
            assert ops[comm.rank].runtime.calls[first:] == calls * 3
            return again, calls, comm.stats.last_gather_path
        results, _ = _run_ranks(n, body)
        for out, calls, path in results:
            assert_same_bytes(out, again_expected)
            if path == "fast":
                copies, memsets = _expected_calls(recipe, rowwise, columnwise, rows, k)
                assert sum(c[0] == "memcpy2D" for c in calls) == copies, (rows, calls)
                assert sum(c[0] == "memset" for c in calls) == memsets, (rows, calls)


def test_steady_state_lane(fake_nccl, monkeypatch, rng):
    """sizes= and out= again: the call takes the lane (no Source, no plan lookup, no output
    checks: no metadata, a cache hit); anything that differs takes the checked path: a
    rank whose rows went stale raises and so do its peers (from its status, on the lane),
    out's buffers replaced are
    checked again, an evicted plan takes its lane with it (then every rank exchanges)."""
    from fp8blk.comm import gather as gather_module
    from fp8blk.tensor import internal_buffers

    n, k, rows = 3, 260, [128, 0, 128]  # Block1D row+col: ranks start at multiples of 128
    every = [[gather_input(rng, r, k) for r in rows] for _ in range(3)]
    expected = [fb.quantize(np.concatenate(e), fb.Block1D(), True, True) for e in every]
    steady = gather_module.gather_steady
    taken = [0] * n

    def counted(comm, *args):
        taken[comm.rank] += 1
        return steady(comm, *args)
    monkeypatch.setattr(gather_module, "gather_steady", counted)
    recipe = fb.Block1D()

    def call(comm, x, sizes=rows, out=None, recipe=recipe):
        return gather_along_first_dim(x, comm, recipe, True, True, sizes=sizes, out=out)[0]

    def body(comm):
        me, cache = comm.rank, plan_cache(comm)
        out = call(comm, every[0][me])
        call(comm, every[1][me], out=out)
        assert len(cache.lanes) == 1 and taken[me] == 0
        comm.reset_stats()
        hits = cache.hits
        assert call(comm, every[2][me], sizes=tuple(rows), out=out) is out
        assert taken[me] == 1 and cache.hits == hits + 1 and comm.stats.meta_calls == 0
        assert_same_bytes(out, expected[2])
        # a recipe equal by value takes it too; sizes as a generator do not (checked path)
        call(comm, every[1][me], out=out, recipe=fb.Block1D())
        call(comm, every[0][me], sizes=(r for r in rows), out=out)
        assert taken[me] == 2
        assert_same_bytes(out, expected[0])
        # one rank's rows went stale: it raises, its peers raise from its status, nobody
        # waits forever
        if me == n - 1:
            with pytest.raises(ValueError, match="joined the collectives with zeros"):
                call(comm, gather_input(rng, rows[me] + 1, k), out=out)
        else:
            with pytest.raises(ValueError, match=f"rank {n - 1} passed an input that is "
                                                 f"invalid or does not match these sizes"):
                call(comm, every[2][me], out=out)
        call(comm, every[2][me], out=out)
        assert_same_bytes(out, expected[2])
        # out's buffer replaced (on every rank): checked again, and rejected
        held = internal_buffers(out)
        kept, held[1] = held[1], np.empty(3, np.float32)
        with pytest.raises(ValueError, match="out's buffer 1"):
            call(comm, every[2][me], out=out)
        held[1] = kept
        call(comm, every[0][me], out=out)
        assert_same_bytes(out, expected[0])
        # evicted with its plan: the next call misses (every rank exchanges) and works
        lane = cache.lanes[id(out)]
        for extra in range(gather_plan.CACHE_SIZE + 2):  # other keys (K), plain ones too
            gather_along_first_dim(np.ones((1, 8 + extra), np.float32), comm,
                                   fb.Block1D() if extra % 2 else None, sizes=[1] * n)
        assert lane.plan.lane is None and id(out) not in cache.lanes
        comm.reset_stats()
        call(comm, every[1][me], out=out)
        assert comm.stats.meta_calls == 2  # the check and the exchange of a miss
        assert_same_bytes(out, expected[1])
        return taken[me]
    results, _ = _run_ranks(n, body)
    # lane calls: the tuple sizes, the equal recipe, the stale call (peers only), the good
    # call after it, the call after out's buffer came back
    assert results == [5, 5, 4]


# --------------------------------------------------------------------------------------------
# One rank's invalid input in the sizes= steady state

INVALID = [("fast", "int32"), ("fast", "1-D"), ("fallback", "int32"), ("fallback", "1-D"),
           ("plain", "0-d")]


def _invalid(x, bad):
    if bad == "int32":
        return np.ones(x.shape, np.int32)  # not a high-precision dtype
    return x[0] if bad == "1-D" else np.ones((), np.float32)  # 0-d


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("with_out", [False, True], ids=["no-out", "out"])
@pytest.mark.parametrize("path,bad", INVALID)
def test_invalid_input_on_one_rank_with_sizes(fake_nccl, monkeypatch, path, bad, with_out,
                                              device, rng):
    """After a few sizes= calls (peers then hit their cached plan or out's lane and skip all
    metadata), one rank passes an invalid input: it joins the peers' collectives with zeros
    (and a nonzero status) and raises its own error; the peers receive zeros for its rows and
    raise a ValueError naming it: host arrays in that call, device arrays at the end of their
    next call (after it issued its collectives); the call after is exact on every rank.
    Without the join the ranks issue different collectives (the fake world raises; real ones
    hang); without the status the peers complete silently."""
    if device:
        _device_ops(monkeypatch, path)
    n, k = 3, 256
    rows = [100, 64, 128] if path == "fallback" else [128, 64, 128]
    recipe = None if path == "plain" else fb.Block1D()
    columnwise = path == "fallback"  # Block1D columnwise, ranks not at multiples of 128
    every = [[gather_input(rng, r, k) for r in rows] for _ in range(5)]
    zeroed = [list(e[:-1]) + [np.zeros_like(e[-1])] for e in every]

    def expected(data):
        full = np.concatenate(data)
        return full if recipe is None else fb.quantize(full, recipe, True, columnwise)

    def check(got, want, joined=False):
        if recipe is None:
            assert np.array_equal(got, want)
        elif path == "fast" and joined:
            # the bad rank's FP8 bytes and scales are the zeros it sent: its data equals the
            # quantize of zero rows, its scale columns are 0 (quantize would write 1.0); the
            # peers' scale columns and the padding are quantize's
            assert np.array_equal(got.rowwise_data.view(np.uint8),
                                  want.rowwise_data.view(np.uint8))
            m0, m1 = sum(rows[:-1]), sum(rows)
            gs, ws = got.rowwise_scale_inv, want.rowwise_scale_inv
            assert np.array_equal(gs[:, :m0].view(np.uint32), ws[:, :m0].view(np.uint32))
            assert not gs[:, m0:m1].any()
            assert np.array_equal(gs[:, m1:].view(np.uint32), ws[:, m1:].view(np.uint32))
        else:
            assert_same_bytes(got, want)

    def call(comm, x, out):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GatherFallbackWarning)
            return gather_along_first_dim(x, comm, recipe, True, columnwise, sizes=rows,
                                          out=out)[0]

    def body(comm):
        me, out = comm.rank, None
        for step in range(3):
            got = call(comm, every[step][me], out)
            check(got, expected(every[step]))
            out = got if with_out else None
        if with_out and path == "fast":  # the lane outranks the last call with these sizes
            call(comm, np.ones((rows[me], 64), np.float32), None)
        comm.reset_stats()
        if me == n - 1:
            kind = TypeError if bad == "int32" else ValueError
            with pytest.raises(kind, match="joined the collectives .* with zeros"):
                call(comm, _invalid(every[3][me], bad), out)
            got = call(comm, every[4][me], out)
        else:
            got = _peer_of_joined(device, lambda: call(comm, every[3][me], out),
                                  lambda: call(comm, every[4][me], out),
                                  f"rank {n - 1} passed an input that is invalid",
                                  lambda got: check(got, expected(zeroed[3]), joined=True))
        if got is not None:
            check(got, expected(every[4]))
        check(call(comm, every[4][me], out), expected(every[4]))
        assert comm.stats.meta_calls == 0  # the peers' steady state, joined: no metadata
        return comm.stats.calls
    results, _ = _run_ranks(n, body)
    assert results == [3] * n  # the joined collective and the next two calls', everywhere


def _device_ops(monkeypatch, path):
    """NumPy arrays taken for device arrays on ``path`` (NCCL's issuer, the fix-up as runtime
    calls, the in-band status copied to host memory behind an event): the results' operations,
    or on the plain path, which moves the caller's arrays, the caller's. Returns the
    :class:`DeviceOps`."""
    ops = DeviceOps()
    if path == "plain":
        monkeypatch.setattr(gather_paths, "ops_for", lambda arr: ops)
    else:
        monkeypatch.setattr(gather_paths, "result_ops", lambda src: ops)
    return ops


def _peer_of_joined(device, joined, following, match, check_zeros):
    """A peer's side of a call that another rank joined with zeros (``joined()``), then of
    the call after it (``following()``): host arrays raise in the joined call; device arrays
    complete it (``check_zeros`` of its result: zeros for that rank's rows) and raise at the
    end of the following call, whose collectives are issued. Returns the following call's
    result (None when it raised)."""
    if not device:
        with pytest.raises(ValueError, match=match):
            joined()
        return following()
    check_zeros(joined())
    with pytest.raises(ValueError, match="a gather_along_first_dim issued earlier .*" + match):
        following()
    return None


# One rank's malformed sizes= (not one non-negative int per rank)

MALFORMED = {"short": lambda rows: rows[:-1], "negative": lambda rows: rows[:-1] + [-1],
             "not-ints": lambda rows: ["many"] * len(rows), "not-a-list": lambda rows: 7}


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("with_out", [False, True], ids=["no-out", "out"])
@pytest.mark.parametrize("path", ["fast", "fallback", "plain"])
@pytest.mark.parametrize("malformed", sorted(MALFORMED))
def test_malformed_sizes_on_one_rank(fake_nccl, monkeypatch, malformed, path, with_out, device,
                                     rng):
    """One rank's sizes= is malformed while its peers pass the true sizes. On a first call
    every rank raises (the exchange). After checked calls (the peers hit their cached plan,
    or out='s lane, and skip all metadata) that rank joins the plan of the latest sizes=
    call that gathers its input, with zeros and status 1, and raises its sizes error; the
    peers receive zeros for its rows and raise a ValueError naming it (host: in that call;
    device: at the end of the next one); the call after is exact everywhere. Without the
    join the rank probes for metadata its peers never exchange (the fake world raises: the
    ranks issue different collectives; real ones hang); without the status the peers
    complete silently."""
    if device:
        _device_ops(monkeypatch, path)
    n, k = 3, 256
    rows = [100, 64, 128] if path == "fallback" else [128, 64, 128]
    recipe = None if path == "plain" else fb.Block1D()
    columnwise = path == "fallback"
    every = [[gather_input(rng, r, k) for r in rows] for _ in range(5)]
    bad_sizes = MALFORMED[malformed](list(rows))
    kind = TypeError if malformed in ("not-ints", "not-a-list") else ValueError

    def expected(data):
        full = np.concatenate(data)
        return full if recipe is None else fb.quantize(full, recipe, True, columnwise)

    def check(got, want):
        if recipe is None:
            assert np.array_equal(got, want)
        else:
            assert np.array_equal(np.asarray(got.rowwise_data).view(np.uint8),
                                  want.rowwise_data.view(np.uint8))

    def call(comm, x, sizes, out=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GatherFallbackWarning)
            return gather_along_first_dim(x, comm, recipe, True, columnwise, sizes=sizes,
                                          out=out)[0]

    def body(comm):
        me, out = comm.rank, None
        # a first call: every rank raises, the bad rank its own error
        with pytest.raises(kind if me == n - 1 else ValueError):
            call(comm, every[0][me], bad_sizes if me == n - 1 else rows)
        for step in range(3):
            got = call(comm, every[step][me], rows, out)
            check(got, expected(every[step]))
            out = got if with_out else None
        # another configuration with the same sizes since: the latest call is not the one
        call(comm, np.ones((rows[me], 64), np.float32), rows)
        comm.reset_stats()
        if me == n - 1:
            with pytest.raises(kind, match="joined the collectives .* with zeros"):
                call(comm, every[3][me], bad_sizes, out)
            got = call(comm, every[4][me], rows, out)
        else:
            zeroed = every[3][:-1] + [np.zeros_like(every[3][-1])]
            got = _peer_of_joined(device, lambda: call(comm, every[3][me], rows, out),
                                  lambda: call(comm, every[4][me], rows, out),
                                  f"rank {n - 1} passed sizes= that are malformed",
                                  lambda got: check(got, expected(zeroed)))
        if got is not None:
            check(got, expected(every[4]))
        check(call(comm, every[4][me], rows, out), expected(every[4]))
        assert comm.stats.meta_calls == 0  # the peers' steady state, joined: no metadata
        return comm.stats.calls
    results, _ = _run_ranks(n, body)
    assert results == [3] * n


# BlockTensor inputs on the fallback: the bytes the ranks hold are kept

def _held(rng, rows, k, recipe, directions):
    """quantize of a (rows, k) bf16 input holding ``directions`` ("r", "c", "rc")."""
    x = gather_input(rng, rows, k).astype(ml_dtypes.bfloat16)
    return fb.quantize(x, recipe, rowwise="r" in directions, columnwise="c" in directions)


def _bytes(a):
    return np.asarray(a).view(np.uint8)


HELD = [  # recipe, rows per rank, the directions each rank holds, the kept direction(s)
    (fb.Block1D(), [128, 128], ["rc", "r"], "r"),        # the held-out case
    (fb.Block1D(), [128, 128, 256], ["r", "rc", "r"], "r"),
    (fb.Block1D(), [100, 156], ["rc", "rc"], "r"),        # columnwise blocks cross ranks
    (fb.MXFP8(), [64, 96], ["rc", "r"], "r"),
    (fb.MXFP8(), [64, 96], ["c", "rc"], "c"),
    (fb.Block1D(), [128, 128], ["r", "c"], ""),           # no direction held everywhere
    (fb.Block2D(), [100, 156], ["rc", "rc"], ""),         # tiles cut: nothing kept
]


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("recipe,rows,held,kept", HELD)
def test_block_tensor_fallback_keeps_held_bytes(fake_nccl, monkeypatch, recipe, rows, held,
                                                kept, device, rng):
    """Both directions asked of BlockTensors that do not all hold both: a direction every
    rank holds (and can send as it is) is its bytes gathered; a missing one is
    quantize(concat(dequantized shards)) of that direction alone, the shards dequantized
    from the direction every rank holds (rowwise first; with none, from their own). The
    held-out case: rowwise Block1D, one rank without columnwise: re-quantizing the rowwise
    bytes changes some of them (a block whose scaled amax rounds down to 224)."""
    if device:
        ops = DeviceOps()
        monkeypatch.setattr(gather_paths, "result_ops", lambda src: ops)
    n, k = len(rows), 256
    shards = [_held(rng, r, k, recipe, h) for r, h in zip(rows, held)]
    every_row = all("r" in h for h in held)
    every_col = all("c" in h for h in held)
    source = "r" if every_row else "c" if every_col else None

    def values(q, own):
        use = own if source is None else source
        buffers = [q.rowwise_data, q.rowwise_scale_inv, None, None] if "r" in use[:1] else \
            [None, None, q.columnwise_data, q.columnwise_scale_inv]
        return fb.reference.dequantize(recipe, q.shape2d, *buffers, dtype=q.dtype)
    full = np.concatenate([values(q, h) for q, h in zip(shards, held)])
    derived_row = fb.quantize(full, recipe, True, False)
    derived_col = fb.quantize(full, recipe, False, True)

    def body(comm):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GatherFallbackWarning)
            out, _ = gather_along_first_dim(shards[comm.rank], comm, None, True, True)
        assert comm.stats.last_gather_path == "fallback"
        return out
    results, _ = _run_ranks(n, body)
    m = sum(rows)
    for out in results:
        for direction, derived in (("rowwise", derived_row), ("columnwise", derived_col)):
            data, scale = f"{direction}_data", f"{direction}_scale_inv"
            if direction[0] in kept:  # the ranks' own bytes, gathered
                want = [getattr(q, data) for q in shards]
                axis = 1 if direction == "columnwise" and not isinstance(recipe, fb.MXFP8) \
                    else 0
                assert np.array_equal(_bytes(getattr(out, data)),
                                      _bytes(np.concatenate(want, axis=axis))), direction
                if direction == "rowwise" and isinstance(recipe, fb.Block1D):
                    scales = np.concatenate([q.rowwise_scale_inv[:, :r]
                                             for q, r in zip(shards, rows)], axis=1)
                    assert np.array_equal(_bytes(out.rowwise_scale_inv[:, :m]), _bytes(scales))
                else:
                    # row-major scale blocks of the ranks, one after the other (the padding
                    # is quantize's)
                    got = _bytes(getattr(out, scale)).reshape(-1)
                    mine = np.concatenate([_bytes(getattr(q, scale)).reshape(-1)
                                           [: _scale_bytes(recipe, direction, r, k)]
                                           for q, r in zip(shards, rows)])
                    assert np.array_equal(got[: mine.size], mine), direction
            else:
                assert np.array_equal(_bytes(getattr(out, data)), _bytes(getattr(derived, data)))
                assert np.array_equal(_bytes(getattr(out, scale)),
                                      _bytes(getattr(derived, scale))), direction


def _scale_bytes(recipe, direction, rows, k):
    if isinstance(recipe, fb.MXFP8):
        return (rows * ((k // 32 + 3) // 4 * 4) if direction == "rowwise"
                else rows // 32 * ((k + 127) // 128 * 128))
    return -(-rows // 128) * ((k + 3) // 4 * 4) * 4  # Block1D columnwise


def test_held_out_rowwise_bytes_would_change(rng):
    """The held-out case's point: re-quantizing its dequantized rowwise bytes changes some."""
    x = gather_input(np.random.default_rng(5), 256, 256)
    q = fb.quantize(x, fb.Block1D())
    again = fb.quantize(q.dequantize(np.float32), fb.Block1D())
    assert not np.array_equal(_bytes(q.rowwise_data), _bytes(again.rowwise_data))


# The in-band status: asynchronous calls, a device that has not completed yet, the bytes

@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_status_async_pending_and_bytes(fake_nccl, monkeypatch, device, rng):
    """The peers of a rank that joined with zeros: an asynchronous host call raises in
    ``wait()`` (the same call); on the device (synchronous calls: the fake has no streams),
    while the status copy has not completed (events held back) no call raises, and
    ``check_pending`` waits for it and raises; then nothing is pending. Every sizes= call counts the status's 8 bytes in ``stats.bytes``,
    the bad rank's too."""
    ops = _device_ops(monkeypatch, "fast") if device else None
    n, k, rows = 2, 256, [128, 64]
    every = [[gather_input(rng, r, k) for r in rows] for _ in range(4)]
    recipe = fb.Block1D()
    payload = [m * k + 2 * round(-(-m // 4) * 4) * 4 for m in rows]  # data + (2, round4) scales

    def call(comm, x, sizes=rows, async_op=False):
        return gather_along_first_dim(x, comm, recipe, sizes=sizes, async_op=async_op)

    def body(comm):
        from fp8blk.comm.gather import check_pending

        me = comm.rank
        call(comm, every[0][me])
        comm.reset_stats()
        call(comm, every[1][me])
        assert comm.stats.bytes == payload[me] + 8 and comm.stats.calls == 1
        comm.reset_stats()
        if me == 1:
            with pytest.raises(ValueError, match="joined the collectives .* with zeros"):
                call(comm, every[2][me], sizes=rows[:-1], async_op=not device)
        else:
            got, handle = call(comm, every[2][me], async_op=not device)
            if not device:
                with pytest.raises(ValueError, match="rank 1 passed sizes= that are malformed"):
                    handle.wait()
        assert comm.stats.bytes == payload[me] + 8  # the bad rank sends as many bytes
        got, _ = call(comm, every[3][me])
        assert_same_bytes(got, fb.quantize(np.concatenate(every[3]), recipe))
        if device and me == 0:
            assert plan_cache(comm).watch.pending
            with pytest.raises(ValueError, match="issued earlier .* rank 1 passed sizes="):
                check_pending(comm)
            assert not plan_cache(comm).watch.pending
        check_pending(comm)  # nothing (more) to raise
        return True
    if ops is not None:  # the device never completes on its own (one runtime for all ranks)
        ops.runtime.ready = False
    _run_ranks(n, body)
