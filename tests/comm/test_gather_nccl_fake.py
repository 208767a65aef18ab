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
from fp8blk.comm.gather import arrays as gather_arrays
from fp8blk.comm.gather import gather_along_first_dim, plan_cache
from fp8blk.comm.gather import paths as gather_paths
from fp8blk.comm.gather import plan as gather_plan

from .fake_ranks import DeviceOps, FakeNccl, host_nccl, run_ranks
from .gather_checks import assert_same_bytes, gather_input


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
    monkeypatch.setattr(gather_paths, "result_ops", lambda src: gather_arrays.ops_for(src.x))
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
    rank whose rows went stale raises while its peers complete, out's buffers replaced are
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
        # one rank's rows went stale: it raises, its peers complete, nobody waits forever
        if me == n - 1:
            with pytest.raises(ValueError, match="joined the collectives with zeros"):
                call(comm, gather_input(rng, rows[me] + 1, k), out=out)
        else:
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
    and raises its own error; the peers complete (zeros for its rows); the next call on every
    rank is exact. Without the join the ranks issue different collectives (the fake world
    raises; real ones hang)."""
    if device:  # the device path: NCCL's issuer, the fix-up as runtime calls
        ops = DeviceOps()
        monkeypatch.setattr(gather_paths, "result_ops", lambda src: ops)
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
        else:
            check(call(comm, every[3][me], out), expected(zeroed[3]), joined=True)
        got = call(comm, every[4][me], out)
        check(got, expected(every[4]))
        assert comm.stats.meta_calls == 0  # the peers' steady state, joined: no metadata
        return comm.stats.calls
    results, _ = _run_ranks(n, body)
    assert results == [2] * n  # the joined collective and the next call's, everywhere


# One rank's malformed sizes= (not one non-negative int per rank)

MALFORMED = {"short": lambda rows: rows[:-1], "negative": lambda rows: rows[:-1] + [-1],
             "not-ints": lambda rows: ["many"] * len(rows), "not-a-list": lambda rows: 7}


@pytest.mark.parametrize("with_out", [False, True], ids=["no-out", "out"])
@pytest.mark.parametrize("path", ["fast", "fallback", "plain"])
@pytest.mark.parametrize("malformed", sorted(MALFORMED))
def test_malformed_sizes_on_one_rank(fake_nccl, malformed, path, with_out, rng):
    """One rank's sizes= is malformed while its peers pass the true sizes. On a first call
    every rank raises (the exchange). After checked calls (the peers hit their cached plan,
    or out='s lane, and skip all metadata) that rank joins the plan of the latest sizes=
    call that gathers its input, with zeros, and raises its sizes error; the peers complete
    with zeros for its rows; the next call is exact everywhere. Without the join the rank
    probes for metadata its peers never exchange (the fake world raises: the ranks issue
    different collectives; real ones hang)."""
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
        else:
            zeroed = every[3][:-1] + [np.zeros_like(every[3][-1])]
            check(call(comm, every[3][me], rows, out), expected(zeroed))
        check(call(comm, every[4][me], rows, out), expected(every[4]))
        assert comm.stats.meta_calls == 0  # the peers' steady state, joined: no metadata
        return comm.stats.calls
    results, _ = _run_ranks(n, body)
    assert results == [2] * n


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
