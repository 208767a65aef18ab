"""The master-weight kernels (fp8blk/kernels/partial.py, _partial_amax_kernel.py,
_partial_cast_kernel.py): PTX for sm_90 without a GPU; under the simulator (background jobs,
tests/sim_jobs.py) the partial amaxes against the reference and the whole device path (amax,
all-reduce, scales, cast) against quantize, byte for byte, fragments and fast paths included;
the batch table (constant launches for 100 weights, reuse while shapes and addresses stay);
the same on the GPU (-m gpu, see tests/master/test_master.py).
"""
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import master
from fp8blk.kernels import _numba
from fp8blk.kernels import _partial_amax_kernel as pak
from fp8blk.kernels import _partial_cast_kernel as pc
from fp8blk.kernels import _specs as dev
from fp8blk.kernels import partial
from tests import sim_jobs
from tests.kernels import _ptx
from tests.master.scripts import cases

needs_compiler = pytest.mark.skipif(_numba.SIM, reason="compile_ptx needs the real Numba CUDA "
                                                        "target (this process is simulated)")


def run_sim(what):
    """The result of tests/master/scripts/sim_checks.py `what` under the simulator (run in the
    background from the end of collection: tests/sim_jobs.py); assert it passed."""
    code, out, err, seed = sim_jobs.result(what)
    assert code == 0 and f"OK {what}" in out, f"seed={seed}\n{out[-3000:]}\n{err[-6000:]}"


# the kernels' PTX, made in the session's PTX job (tests/kernels/_ptx.py)
AMAX_CASES = [(True, dev.BF16, False), (False, dev.BF16, True), (False, dev.F32, False)]
CAST_CASES = [(True, dev.BF16, True, False),  # transposed Block2D storage: general path only
              (True, dev.BF16, False, True),
              (False, dev.BF16, True, False), (False, dev.BF16, True, True),
              (False, dev.F16, False, False), (False, dev.F16, False, True)]


def _amax_key(*args):
    return "partial_amax/" + "-".join(map(str, args))


def _cast_key(*args):
    return "partial_cast/" + "-".join(map(str, args))


def _scale_key(block2d):
    return f"partial_scale/{block2d}"


def _register():
    for b2, model, col in AMAX_CASES:
        for fast in (False, True):
            _ptx.case(_amax_key(b2, model, col, fast), lambda a=(b2, model, col, fast): (
                pak.amax_pyfunc(*a), pak.amax_argtypes(a[0]), None))
    # and the with-columns kernel each row-only case is compared with
    with_col = [(False, m, True, f) for b2, m, col, f in CAST_CASES if not b2 and not col]
    for b2, model, col, fast in CAST_CASES + with_col:
        _ptx.case(_cast_key(b2, model, col, fast), lambda a=(b2, model, col, fast): (
            pc.cast_pyfunc(*a), pc.cast_argtypes(a[0]), None))
    for b2 in (True, False):
        _ptx.case(_scale_key(b2), lambda b2=b2: (
            pc.scale_pyfunc(b2, 3.3895313892515355e38), pc.scale_argtypes(b2), None))


_register()


@needs_compiler
@pytest.mark.parametrize("fast_path", [False, True])
@pytest.mark.parametrize("block2d,model,with_col", AMAX_CASES)
def test_amax_kernel_compiles_for_sm90(block2d, model, with_col, fast_path):
    ptx = _ptx.ptx(_amax_key(block2d, model, with_col, fast_path))
    assert ".target sm_90" in ptx
    assert "ld.global.nc.v4.u32" in ptx       # 16-byte loads on the aligned path
    assert "shfl.sync.bfly" in ptx            # warp reductions, not shared-memory loops
    assert ".local" not in ptx                # the per-thread arrays stay in registers
    col_stores = ptx.count("st.global.u32")   # MXFP8 columnwise codes, 4 per 32-bit store
    assert (col_stores > 0) == (with_col and not block2d)


def test_partial_amax_matches_reference_in_simulator():
    run_sim("amax")


def _batch_of(n_weights, rng):
    """A mixed batch of `n_weights` small weights, each half-owned by this rank."""
    kinds = [(fb.Block2D(), True, False), (fb.Block2D(fb.E5M2, False), True, True),
             (fb.MXFP8(), True, True), (fb.MXFP8(fb.E5M2), True, False)]
    specs = [cases.Spec((64, 96), *kinds[i % 4]) for i in range(n_weights)]
    weights = [cases.alloc_weight(s, rng) for s in specs]
    masters = [np.zeros(64 * 48, np.float32) if i % 3 else None for i in range(n_weights)]
    items, _ = master.validate(weights, masters, [64 * 48] * n_weights, None)
    return items


def test_batch_is_reused_while_shapes_and_addresses_stay(rng):
    """batch_for (GPU path; here on host arrays outside the simulator) returns the cached Batch
    for the same shapes, shard places and array addresses, a new one when any changes, and the
    cache keeps no caller array alive."""
    import gc
    import weakref

    partial.clear_caches()
    items = _batch_of(6, rng)
    bucket = [it for it in items if isinstance(it.recipe, fb.MXFP8)]
    first = partial.batch_for(bucket, have_fragments=False)
    fresh = partial.Batch(bucket, have_fragments=False)
    assert np.array_equal(first.table, fresh.table) and first.n_items == len(bucket)
    again, _ = master.validate([it.weight for it in items], [it.master for it in items],
                               [it.start for it in items], None)
    assert partial.batch_for([it for it in again if isinstance(it.recipe, fb.MXFP8)], False) is first
    assert partial.batch_for(bucket, have_fragments=True) is not first
    moved = [it for it in items]
    owner = next(i for i, it in enumerate(bucket) if it.master is not None)
    new_master = bucket[owner].master.copy()  # same values, another address
    shifted, _ = master.validate([it.weight for it in moved],
                                 [new_master if it is bucket[owner] else it.master
                                  for it in moved], [it.start for it in moved], None)
    other = partial.batch_for([it for it in shifted if isinstance(it.recipe, fb.MXFP8)], False)
    assert other is not first
    ref = weakref.ref(new_master)
    del new_master, shifted, other
    gc.collect()
    assert ref() is None, "the batch cache kept a master array alive"
    partial.clear_caches()


@pytest.mark.parametrize("n_weights", [4, 100])
def test_launches_do_not_grow_with_the_batch(n_weights, rng):
    """One launch per kernel specialization present, whatever the number of weights."""
    items = _batch_of(n_weights, rng)
    for block2d in (True, False):
        bucket = [it for it in items if isinstance(it.recipe, fb.Block2D) == block2d]
        batch = partial.Batch(bucket, have_fragments=False)
        assert len(batch.amax_launches) <= (1 if block2d else 2)
        assert len(batch.cast_launches) <= 2
        # every weight's first block / entry is inside its launch's prefix order
        t = batch.table.reshape(-1, partial.NF)
        assert np.all(np.diff(t[:, partial.F_SCALE0]) >= 0)
        # the packed buffer: 4-byte tile amaxes (Block2D) or 1-byte codes (MXFP8)
        want = sum(it.row_blocks + it.col_blocks for it in bucket)
        assert batch.buf_entries == want


def test_table_rejects_weights_too_large_for_32_bit_indexing():
    spec = cases.Spec((64, 64), fb.Block2D())
    w = cases.alloc_weight(spec, np.random.default_rng(0))
    items, _ = master.validate([w], [np.zeros(10, np.float32)], [0], None)
    items[0].h = 1 << 16
    items[0].w = 1 << 15
    with pytest.raises(ValueError, match="32 bits"):
        partial.Batch(items, have_fragments=False)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1, 64])
def test_gpu_partial_amax_matches_reference(scale, rng):
    """The simulator's checks on the GPU, at the tiny shapes and 64 times taller."""
    cp = pytest.importorskip("cupy")
    from tests.master.scripts import kernel_checks

    kernel_checks.check_amax(rng, xp=cp, scale=scale)


# -- scale and cast kernels -------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("block2d,model,with_col,fast_path", CAST_CASES)
def test_cast_kernel_compiles_for_sm90(block2d, model, with_col, fast_path):
    ptx = _ptx.ptx(_cast_key(block2d, model, with_col, fast_path))
    assert ".target sm_90" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.satfinite.e5m2x2.f32" in ptx
    assert "ld.global.nc.v4.u32" in ptx       # 16-byte master loads
    assert "st.global.u32" in ptx             # 4 FP8 bytes per store where aligned
    assert ".local" not in ptx
    assert "div.s64" not in ptx and "rem.s64" not in ptx  # 32-bit index division only
    if not block2d and not with_col:
        # the row-only specialization has no columnwise code at all: no loads of column E8M0
        # code words and no more casts (whether LLVM also unswitches the with-columns loop on
        # the format, doubling its casts, depends on the loop's size)
        with_col_ptx = _ptx.ptx(_cast_key(False, model, True, fast_path))
        assert ptx.count("ld.global.u32") < with_col_ptx.count("ld.global.u32")
        assert ptx.count("cvt.rn.satfinite") <= with_col_ptx.count("cvt.rn.satfinite")


@needs_compiler
@pytest.mark.parametrize("block2d", [True, False])
def test_scale_kernel_compiles_for_sm90(block2d):
    ptx = _ptx.ptx(_scale_key(block2d))
    assert ".target sm_90" in ptx
    if block2d:
        assert "div.rn.f32" in ptx  # correctly rounded F / amax and 1 / scale


def test_device_path_matches_quantize_in_simulator():
    run_sim("cast")


def test_fast_paths_match_reference_in_simulator():
    """Interior tiles, bands and chunks (the kernels' unpredicated paths) next to edge ones."""
    run_sim("fast")


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1, 32])
def test_gpu_device_path_matches_quantize(scale, rng):
    """The simulator's whole-path checks on the GPU, at the tiny shapes and 32 times taller."""
    cp = pytest.importorskip("cupy")
    from tests.master.scripts import kernel_checks

    kernel_checks.check_cast(rng, xp=cp, scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1, 16])
def test_gpu_fast_paths_match_reference(scale, rng):
    """The simulator's fast-path checks on the GPU, and 16 times taller."""
    cp = pytest.importorskip("cupy")
    from tests.master.scripts import kernel_checks

    kernel_checks.check_fast_paths(rng, xp=cp, scale=scale)
