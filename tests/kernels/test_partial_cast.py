"""Scale and partial-cast kernels of the master-weight path (fp8blk/kernels/partial_cast.py and
_partial_cast_kernel.py):
PTX for sm_90 without a GPU, and the whole device path (amax, all-reduce, scales, cast) under
the simulator against quantize, byte for byte, including fragments and in-range writes."""
import pytest

from fp8blk.kernels import _numba
from fp8blk.kernels import _partial_cast_kernel as pc
from fp8blk.kernels import _specs as dev
from tests.kernels.test_partial_amax import needs_compiler, run_sim


@needs_compiler
@pytest.mark.parametrize("block2d,model,with_col,fast_path", [
    (True, dev.BF16, True, False),  # transposed Block2D storage: general path only
    (True, dev.BF16, False, True), (False, dev.BF16, True, False),
    (False, dev.BF16, True, True), (False, dev.F16, False, False),
    (False, dev.F16, False, True)])
def test_cast_kernel_compiles_for_sm90(block2d, model, with_col, fast_path):
    ptx = _numba.compile_ptx_sm90(pc.cast_pyfunc(block2d, model, with_col, fast_path),
                                  pc.cast_argtypes(block2d))
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
        with_col_ptx = _numba.compile_ptx_sm90(pc.cast_pyfunc(False, model, True, fast_path),
                                               pc.cast_argtypes(False))
        assert ptx.count("ld.global.u32") < with_col_ptx.count("ld.global.u32")
        assert ptx.count("cvt.rn.satfinite") <= with_col_ptx.count("cvt.rn.satfinite")


@needs_compiler
@pytest.mark.parametrize("block2d", [True, False])
def test_scale_kernel_compiles_for_sm90(block2d):
    ptx = _numba.compile_ptx_sm90(pc.scale_pyfunc(block2d, 3.3895313892515355e38),
                                  pc.scale_argtypes(block2d))
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
