"""cast_master_weights on the host: world-size invariance against quantize, one collective per
bucket, payload bytes, fragments, in-range writes, repeated steps, model dtypes, validation.

Ranks are threads sharing an in-process communicator (tests/master/scripts/fake_comm.py); the
same scenarios run under real MPI (mpiexec, tests/master/scripts/mpi_invariance.py) in
test_mpi_world_size_invariance.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8blk as fb
from fp8blk import scaling
from fp8blk.master import cast_master_weights
from fp8blk.tensor import from_internal
from tests.master.scripts import cases
from tests.master.scripts.fake_comm import run_ranks


def _run(specs, fulls, ranges, size, seed, fragments=False, model_dtype=cases.BF16,
         weights=None):
    """One call on `size` thread-ranks; returns (weights, fragments, stats) per rank."""
    def body(rank, comm):
        rng = np.random.default_rng([seed, rank])
        ws = weights[rank] if weights else [cases.alloc_weight(s, rng) for s in specs]
        masters, starts = cases.rank_inputs(specs, fulls, ranges, rank, rng)
        frags = cases.make_fragments(specs, ranges, rank, rng)[0] if fragments else None
        cast_master_weights(ws, masters, starts, comm, fragments=frags, model_dtype=model_dtype)
        return ws, frags, comm.stats
    out = run_ranks(size, body)
    return [o[0] for o in out], ([o[1] for o in out] if fragments else None), [o[2] for o in out]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", cases.SCENARIOS)
def test_world_size_invariance(name, size, rng):
    _check_world_size_invariance(_run, name, size, rng)


def _check_world_size_invariance(run, name, size, rng):
    """``run`` (the host or the GPU path) on scenario ``name`` cut for ``size`` ranks: exact,
    and exactly one collective per recipe bucket with the expected payload."""
    specs = cases.scenario(name)
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)
    weights, _, stats = run(specs, fulls, ranges, size, int(rng.integers(1 << 30)))
    cases.check(specs, fulls, ranges, weights)
    calls, b2_bytes, mx_bytes = cases.expected_payload(specs)
    for s in stats:
        assert s.calls == calls
        assert s.bytes == b2_bytes + mx_bytes


def test_mxfp8_payload_is_half_of_bf16_amaxes(rng):
    specs = cases.scenario("mxfp8_mixed")
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, 2)
    _, _, stats = _run(specs, fulls, ranges, 2, 7)
    blocks = sum(s.shape[0] * s.shape[1] // 32 * (int(s.rowwise) + int(s.columnwise))
                 for s in specs)
    bf16_amax_bytes = 2 * blocks
    assert stats[0].calls == 1
    assert 2 * stats[0].bytes == bf16_amax_bytes


def test_block_boundaries_and_empty_ranks():
    """Hand-picked cuts: inside a 1x32 block, inside a 128x128 tile, exactly on a boundary, and
    ranks owning nothing (None and empty arrays)."""
    rng = np.random.default_rng(5)
    specs = [cases.Spec((256, 96), fb.Block2D(fb.E4M3, False), columnwise=True),
             cases.Spec((256, 96), fb.MXFP8(fb.E4M3), columnwise=True)]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    total = 256 * 96
    for bounds in ([0, 17, 17, 128 * 96 + 5, total], [0, 0, total, total, total],
                   [0, 96 * 32, 96 * 32 + 1, total - 1, total]):
        ranges = [[(bounds[r], bounds[r + 1] - bounds[r]) for r in range(4)] for _ in specs]
        weights, _, _ = _run(specs, fulls, ranges, 4, 11)
        cases.check(specs, fulls, ranges, weights)


def test_repeated_calls_stay_exact(rng):
    specs = cases.scenario("batch20")
    size = 3
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)
    weights = None
    for step in range(3):
        weights, _, stats = _run(specs, fulls, ranges, size, step, weights=weights)
        cases.check(specs, fulls, ranges, weights)
        fulls = [cases.step_full(rng, f) for f in fulls]
    # fresh communicators per step: one call per bucket each time
    assert stats[0].calls == 2


def _writable_specs():
    """batch20 without the column-only Block2D weight (fragments cannot address it)."""
    return [s for s in cases.scenario("batch20")
            if not (isinstance(s.recipe, fb.Block2D) and not s.rowwise)]


@pytest.mark.parametrize("size", [1, 3])
def test_fragments_equal_in_place(size, rng):
    specs = _writable_specs() + cases.scenario("mxfp8_mixed")
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)
    seed = int(rng.integers(1 << 30))
    in_place, _, _ = _run(specs, fulls, ranges, size, seed)
    with_frags, frags, _ = _run(specs, fulls, ranges, size, seed, fragments=True)
    cases.check(specs, fulls, ranges, with_frags, rank_fragments=frags)
    for r in range(size):
        for i, spec in enumerate(specs):
            o, n = ranges[i][r]
            frag = frags[r][i]
            parts = frag if isinstance(frag, tuple) else (frag,)
            for d, part in enumerate(parts):
                if part is None:
                    continue
                src = in_place[r][i]._buffers[2 * d].reshape(-1)
                np.testing.assert_array_equal(part, src[o: o + n])
            for b_in, b_frag in zip(in_place[r][i]._buffers[1::2],
                                    with_frags[r][i]._buffers[1::2]):
                if b_in is not None:  # scales are written into the weight either way
                    np.testing.assert_array_equal(b_in.view(np.uint8), b_frag.view(np.uint8))


def test_writes_stay_inside_the_owned_range(rng):
    """Data bytes outside [o, o+n) (and fragment guard bytes, and with fragments the weight's
    own data buffers) keep their garbage."""
    specs = _writable_specs() + cases.scenario("block2d_pow2")
    size = 3
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)

    def body(rank, comm):
        r = np.random.default_rng([3, rank])
        ws = [cases.alloc_weight(s, r) for s in specs]
        before = [[None if b is None else b.copy() for b in w._buffers] for w in ws]
        masters, starts = cases.rank_inputs(specs, fulls, ranges, rank, r)
        cast_master_weights(ws, masters, starts, comm)
        ws2 = [cases.alloc_weight(s, r) for s in specs]
        before2 = [[None if b is None else b.copy() for b in w._buffers] for w in ws2]
        frags, guarded = cases.make_fragments(specs, ranges, rank, r)
        guards = [[None if g is None else g.copy() for g in gs] for gs in guarded]
        cast_master_weights(ws2, masters, starts, comm, fragments=frags)
        return ws, before, ws2, before2, guarded, guards

    for rank, (ws, before, ws2, before2, guarded, guards) in enumerate(run_ranks(size, body)):
        for i, spec in enumerate(specs):
            o, n = ranges[i][rank]
            h, w = spec.shape
            flat = np.arange(o, o + n, dtype=np.int64)
            for d in (0, 1):
                data, old = ws[i]._buffers[2 * d], before[i][2 * d]
                if data is None:
                    continue
                owned = np.zeros(h * w, bool)
                transposed = isinstance(spec.recipe, fb.Block2D) and d == 1
                owned[(flat % w) * h + flat // w if transposed else flat] = True
                np.testing.assert_array_equal(data.reshape(-1)[~owned], old.reshape(-1)[~owned])
                # with fragments the weight's data buffers are not touched at all
                np.testing.assert_array_equal(ws2[i]._buffers[2 * d], before2[i][2 * d])
            for g, g_old in zip(guarded[i], guards[i]):
                if g is not None:
                    np.testing.assert_array_equal(g[: cases.GUARD], g_old[: cases.GUARD])
                    np.testing.assert_array_equal(g[cases.GUARD + n:], g_old[cases.GUARD + n:])


def test_overflow_scale_uses_the_model_dtype_max():
    """A tile whose amax is below F/FLT_MAX: F/amax overflows fp32. With pow2_scales=False the
    result matches quantize(bf16(...)) (bf16 max) and NOT the FLT_MAX variant."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((256, 256)).astype(np.float32)
    full[:128, :128] = (rng.standard_normal((128, 128)) * 1e-37).astype(np.float32)
    recipe = fb.Block2D(fb.E4M3, pow2_scales=False)
    spec = cases.Spec((256, 256), recipe)
    ranges = [[(0, 256 * 100 + 3), (256 * 100 + 3, 256 * 156 - 3)]]
    weights, _, _ = _run([spec], [full], ranges, 2, 1)
    cases.check([spec], [full], ranges, weights)
    amax = np.float32(np.abs(full[:128, :128].astype(cases.BF16).astype(np.float32)).max())
    with_bf16_max = scaling.fp32_scale_from_amax(amax, fb.E4M3, False, 0.0,
                                                 scaling.dtype_max(cases.BF16))
    with_flt_max = scaling.fp32_scale_from_amax(amax, fb.E4M3, False, 0.0, scaling.FLT_MAX)
    assert with_bf16_max != with_flt_max  # the case really is the overflow case
    got = weights[0][0]._buffers[1][0, 0]
    assert got == scaling.scale_inv_from_scale(with_bf16_max)


class _FlushingMax:
    """A fake-comm rank whose float MAX flushes subnormal inputs to zero first, as CuPy's
    reductions (built with -ftz=true) do on the GPU; integer MAX stays exact."""

    def __init__(self, comm):
        self._comm = comm
        self.stats = comm.stats
        self.rank, self.size, self.metadata = comm.rank, comm.size, comm.metadata

    def all_reduce(self, buf, op="max"):
        if buf.dtype.kind == "f":
            buf[np.abs(buf) < np.finfo(buf.dtype).tiny] = 0
        self._comm.all_reduce(buf, op)


@pytest.mark.parametrize("pow2", [True, False])
def test_subnormal_tile_amax_survives_a_flushing_reduce(pow2, rng):
    """Tiles whose amax is subnormal (NaNs + a few 2**-133, as make_full makes them; all tiny
    subnormals) must get the overflow scale, not scale 1, even through a collective whose float
    MAX flushes subnormals (the H200 failure: Block2D amaxes are reduced as int32 bits)."""
    h, w = 256, 160
    full = cases.make_full(rng, (h, w))
    full[:128, :128] = np.nan
    full[5, 7] = np.float32(2.0 ** -133)
    full[100, 3] = -np.float32(2.0 ** -131)
    sub = rng.integers(1, 1 << 16, size=(128, w - 128)).astype(np.float32) * np.float32(2 ** -149)
    full[128:, 128:] = sub * rng.choice([-1, 1], size=sub.shape).astype(np.float32)
    full[128:, 128:][rng.random(sub.shape) < 0.3] = 0.0
    spec = cases.Spec((h, w), fb.Block2D(fb.E4M3, pow2_scales=pow2), columnwise=True)
    cut = int(rng.integers(0, h * w + 1))
    ranges = [[(0, cut), (cut, h * w - cut)] if cut < h * w else [(0, cut), (0, 0)]]

    def body(rank, comm):
        ws = [cases.alloc_weight(spec, np.random.default_rng([1, rank]))]
        masters, starts = cases.rank_inputs([spec], [full], ranges, rank, rng=np.random.
                                            default_rng([2, rank]))
        cast_master_weights(ws, masters, starts, _FlushingMax(comm))
        return ws
    weights = run_ranks(2, body)
    cases.check([spec], [full], ranges, weights)
    assert weights[0][0]._buffers[1][0, 0] < np.finfo(np.float32).tiny  # overflow scale_inv


@pytest.mark.parametrize("model_dtype", [np.float32, np.float16, cases.BF16])
def test_model_dtypes(model_dtype, rng):
    specs = [s for s in cases.scenario("batch20") if s.master_dtype == cases.F32]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, 2)
    weights, _, _ = _run(specs, fulls, ranges, 2, 3, model_dtype=model_dtype)
    cases.check(specs, fulls, ranges, weights, model_dtype=np.dtype(model_dtype))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_random_shapes_and_cuts(data):
    """Arbitrary shapes, recipes and cut points (hypothesis picks them)."""
    size = data.draw(st.integers(1, 4), label="size")
    mx = data.draw(st.booleans(), label="mxfp8")
    if mx:
        shape = (32 * data.draw(st.integers(1, 5)), 32 * data.draw(st.integers(1, 5)))
        recipe = fb.MXFP8(data.draw(st.sampled_from([fb.E4M3, fb.E5M2])))
    else:
        shape = (data.draw(st.integers(1, 300)), data.draw(st.integers(1, 300)))
        recipe = fb.Block2D(data.draw(st.sampled_from([fb.E4M3, fb.E5M2])),
                            data.draw(st.booleans()),
                            data.draw(st.sampled_from([0.0, 1e-30, 1e-3])))
    col = data.draw(st.booleans(), label="columnwise")
    spec = cases.Spec(shape, recipe, rowwise=True, columnwise=col)
    total = shape[0] * shape[1]
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=size - 1,
                                     max_size=size - 1)))
    bounds = [0] + cuts + [total]
    ranges = [[(bounds[r], bounds[r + 1] - bounds[r]) for r in range(size)]]
    full = cases.make_full(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), shape)
    weights, _, _ = _run([spec], [full], ranges, size, 0)
    cases.check([spec], [full], ranges, weights)


def test_torch_masters_and_fragments():
    """Masters and fragments may be CPU torch tensors (bf16 model dtype given as torch's)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    spec = cases.Spec((64, 96), fb.MXFP8(fb.E4M3), columnwise=True)
    full = cases.make_full(rng, spec.shape)
    n = 64 * 96 - 10
    frag = (torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8))

    def body(rank, comm):
        w = cases.alloc_weight(spec, np.random.default_rng(rank))
        if rank == 0:
            cast_master_weights([w], [full.reshape(-1)[:10].copy()], [0], comm)
        else:
            master = torch.from_numpy(full.reshape(-1)[10:].copy())
            cast_master_weights([w], [master], [10], comm, fragments=[frag],
                                model_dtype=torch.bfloat16)
        return w
    w0, _ = run_ranks(2, body)
    want = cases.expected_buffers(spec, full)
    np.testing.assert_array_equal(frag[0].numpy(), want[0].reshape(-1)[10:])
    np.testing.assert_array_equal(frag[1].numpy(), want[2].reshape(-1)[10:])
    np.testing.assert_array_equal(w0._buffers[0].reshape(-1)[:10], want[0].reshape(-1)[:10])


def test_empty_batch_makes_no_data_collective():
    """An empty batch still meets the other ranks (one of them might pass weights), through
    metadata collectives only."""
    stats = run_ranks(2, lambda r, c: (cast_master_weights([], [], [], c), c.stats)[1])
    assert stats[0].calls == 0 and stats[0].meta_calls >= 1


# --------------------------------------------------------------------------------------------
# Real MPI (mpiexec subprocesses)

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.mark.mpi
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_mpi_world_size_invariance(size):
    pytest.importorskip("mpi4py")
    if not os.path.exists(_MPIEXEC):
        pytest.skip(f"no mpiexec beside {sys.executable} (pip install mpich)")
    seed = int.from_bytes(os.urandom(4), "little")
    cmd = [_MPIEXEC, "-n", str(size), sys.executable, "-m", "mpi4py",
           "-m", "tests.master.scripts.mpi_invariance", str(seed)]
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and f"OK {size}" in proc.stdout, (
        f"seed={seed}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


# --------------------------------------------------------------------------------------------
# Validation


class _NoComm:
    pass


def _one(recipe=None, shape=(64, 64), columnwise=False):
    spec = cases.Spec(shape, recipe or fb.Block2D(), columnwise=columnwise)
    return spec, cases.alloc_weight(spec, np.random.default_rng(0))


def _call(weights, masters, starts, fragments=None, model_dtype=cases.BF16, comm=None):
    def body(rank, c):
        cast_master_weights(weights, masters, starts, comm or c, fragments=fragments,
                            model_dtype=model_dtype)
    run_ranks(1, body)


def test_errors_name_the_problem():
    spec, w = _one()
    m = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match="one entry per weight"):
        _call([w], [m, m], [0])
    with pytest.raises(TypeError, match="list or tuple"):
        _call(w, [m], [0])
    with pytest.raises(ValueError, match="flat"):
        _call([w], [np.zeros((10, 10), np.float32)], [0])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        _call([w], [np.zeros(100, np.float16)], [0])
    with pytest.raises(ValueError, match="outside"):
        _call([w], [m], [64 * 64 - 50])
    with pytest.raises(ValueError, match="outside"):
        _call([w], [m], [-1])
    with pytest.raises(TypeError, match="start_offsets"):
        _call([w], [m], [1.5])
    with pytest.raises(TypeError, match="model_dtype"):
        _call([w], [m], [0], model_dtype=np.int8)
    with pytest.raises(TypeError, match="all_reduce"):
        _call([w], [m], [0], comm=_NoComm())
    with pytest.raises(TypeError, match="BlockTensor"):
        _call([np.zeros((64, 64))], [m], [0])
    q1 = fb.quantize(np.ones((64, 128), np.float32), fb.Block1D())
    with pytest.raises(TypeError, match="Block2D and MXFP8"):
        _call([q1], [m], [0])
    with pytest.raises(TypeError, match="pair"):
        _call([w], [m], [0], fragments=[(np.zeros(100, np.uint8), None)])
    with pytest.raises(ValueError, match=r"shape \(100,\)"):
        _call([w], [m], [0], fragments=[np.zeros(99, np.uint8)])
    with pytest.raises(ValueError, match="is None"):
        _call([w], [m], [0], fragments=[None])


def test_errors_name_the_entry_at_fault():
    """A bad entry is named by its place in its list (``masters[i]``, ``fragments[i]``,
    ``weights[i]``), whichever check finds it: here the second of two."""
    _, w0 = _one()
    _, w1 = _one()
    m = np.zeros(64 * 64, np.float32)
    with pytest.raises(TypeError, match=r"^masters\[1\]: expected a numpy\.ndarray, cupy\.ndarray "
                                        r"or torch\.Tensor, got builtins\.list"):
        _call([w0, w1], [m, m.tolist()], [0, 0])
    with pytest.raises(TypeError, match=r"^fragments\[1\]: expected .*got builtins\.bytes"):
        _call([w0, w1], [m, m], [0, 0], fragments=[np.zeros(m.size, np.uint8), bytes(m.size)])
    w1.rowwise_data.shape = (32, 128)  # the weight's own buffer, reshaped after construction
    with pytest.raises(ValueError, match=r"^weights\[1\] rowwise_data is uint8\(32, 128\), "
                                         r"expected uint8\(64, 64\)"):
        _call([w0, w1], [m, m], [0, 0])


def test_errors_on_storage_and_mxfp8_fragments():
    spec, w = _one(fb.MXFP8(), (64, 64), columnwise=False)
    m = np.zeros(100, np.float32)
    with pytest.raises(TypeError, match="pair"):
        _call([w], [m], [0], fragments=[np.zeros(100, np.uint8)])
    with pytest.raises(ValueError, match="does not hold"):
        _call([w], [m], [0], fragments=[(np.zeros(100, np.uint8), np.zeros(100, np.uint8))])
    # the public constructor refuses such tensors; buffers swapped in afterwards (internal
    # code, from_internal) are still checked by cast_master_weights
    bad_bufs = [np.zeros((64, 64), np.uint8), np.zeros((64, 2), np.uint8), None, None]
    with pytest.raises(ValueError, match="rowwise_scale_inv"):
        fb.BlockTensor((64, 64), fb.MXFP8(), *bad_bufs)
    bad = from_internal((64, 64), fb.MXFP8(), bad_bufs, np.dtype(np.float32), "numpy")
    with pytest.raises(ValueError, match="rowwise_scale_inv"):
        _call([bad], [m], [0])
    ro = np.zeros((64, 64), np.uint8)
    ro.flags.writeable = False
    bad = fb.BlockTensor((64, 64), fb.Block2D(), ro, np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match="read-only"):
        _call([bad], [m], [0])
    bad_bufs = [np.zeros((64, 48), np.uint8), np.zeros((128, 4), np.uint8), None, None]
    with pytest.raises(ValueError, match="multiples of 32"):
        fb.BlockTensor((64, 48), fb.MXFP8(), *bad_bufs)
    bad = from_internal((64, 48), fb.MXFP8(), bad_bufs, np.dtype(np.float32), "numpy")
    with pytest.raises(ValueError, match="multiples of 32"):
        _call([bad], [m], [0])
    empty = fb.BlockTensor((64, 64), fb.Block2D())
    with pytest.raises(ValueError, match="no storage"):
        _call([empty], [m], [0])


# --------------------------------------------------------------------------------------------
# GPU (-m gpu, the lent H200): the CUDA kernels, every rank a thread on the one GPU


def _run_gpu(specs, fulls, ranges, size, seed, fragments=False, model_dtype=cases.BF16):
    cp = pytest.importorskip("cupy")
    from tests.master.scripts.kernel_checks import device_run

    return device_run(specs, fulls, ranges, size, seed, fragments, model_dtype, cp)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", cases.SCENARIOS)
def test_gpu_world_size_invariance(name, size, rng):
    _check_world_size_invariance(_run_gpu, name, size, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 3])
def test_gpu_fragments_and_repeated_steps(size, rng):
    specs = _writable_specs() + cases.scenario("mxfp8_mixed")
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)
    for step in range(2):
        weights, frags, _ = _run_gpu(specs, fulls, ranges, size, step, fragments=True)
        cases.check(specs, fulls, ranges, weights, rank_fragments=frags)
        fulls = [cases.step_full(rng, f) for f in fulls]


@pytest.mark.gpu
@pytest.mark.parametrize("model_dtype", [np.float32, np.float16])
def test_gpu_model_dtypes(model_dtype, rng):
    specs = [s for s in cases.scenario("batch20") if s.master_dtype == cases.F32]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, 2)
    weights, _, _ = _run_gpu(specs, fulls, ranges, 2, 3, model_dtype=model_dtype)
    cases.check(specs, fulls, ranges, weights, model_dtype=np.dtype(model_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 4])
def test_gpu_large_unaligned_weights(size, rng):
    """Large weights, odd shapes for Block2D, cuts at odd offsets (no 16-byte alignment)."""
    specs = [cases.Spec((4096 + 77, 3072 + 5), fb.Block2D(fb.E4M3, False), columnwise=True),
             cases.Spec((4096, 3072), fb.MXFP8(fb.E4M3), columnwise=True),
             cases.Spec((2048, 6144), fb.MXFP8(fb.E5M2), columnwise=False,
                        master_dtype=cases.BF16)]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)
    weights, _, _ = _run_gpu(specs, fulls, ranges, size, 5)
    cases.check(specs, fulls, ranges, weights)


@pytest.mark.gpu
def test_gpu_steps_on_the_same_arrays_reuse_the_batch(rng):
    """A training loop's steady state: the same weights and master shards, updated in place
    each step. The batch table is built once (later calls reuse it) and every step stays
    exact."""
    cp = pytest.importorskip("cupy")
    from fp8blk.kernels import partial

    specs = cases.scenario("batch20")
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, 1)

    def body(rank, comm):
        ws = [cases.alloc_weight(s, rng, xp=cp) for s in specs]
        masters, starts = cases.rank_inputs(specs, fulls, ranges, rank, rng, xp=cp)
        built = []
        for step in range(3):
            if step:
                fresh, _ = cases.rank_inputs(specs, steps[step], ranges, rank, rng, xp=cp)
                for m, f in zip(masters, fresh):
                    if m is not None and m.size:
                        m[...] = f  # in place: same addresses
            before = partial.counters["batches_built"]
            cast_master_weights(ws, masters, starts, comm)
            built.append(partial.counters["batches_built"] - before)
            cp.cuda.get_current_stream().synchronize()
            cases.check(specs, steps[step], ranges, [ws])
        return built

    steps = [fulls]
    for _ in range(2):
        steps.append([cases.step_full(rng, f) for f in steps[-1]])
    partial.clear_caches()
    built = run_ranks(1, body)[0]
    assert built[1:] == [0, 0], f"batches built per step: {built}"
