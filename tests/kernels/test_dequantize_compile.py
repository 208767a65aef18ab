"""Every dequantize kernel variant compiles to PTX for compute capability 9.0 without a GPU, keeps
subnormal products, uses no local memory, and the intended loads, stores and conversions."""
import os
import re

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real Numba CUDA target, not the simulator",
                allow_module_level=True)

from fp8blk.kernels import _dequantize_kernel as dk  # noqa: E402
from fp8blk.kernels import _specs as dq  # noqa: E402

from . import _ptx  # noqa: E402

LOCAL = re.compile(r"\b(ld|st)\.local\b")


def _dequant_specs():
    """Every vector-path variant (rows: (M, K) sources; tiles: transposed (K, M) ones, rows
    16-byte aligned or not) for the three output kinds, formats alternating; 4-element pieces
    of 16-bit outputs; the scalar fallback once per source layout."""
    specs = []
    for path, recipe, cw, aligned in (
            (dq.ROWS, dq.BLOCK1D, False, True), (dq.ROWS, dq.BLOCK2D, False, True),
            (dq.ROWS, dq.MXFP8, False, True), (dq.ROWS, dq.MXFP8, True, True),
            (dq.TILES, dq.BLOCK1D, True, True), (dq.TILES, dq.BLOCK2D, True, True),
            (dq.TILES, dq.BLOCK1D, True, False), (dq.TILES, dq.BLOCK2D, True, False)):
        for out_kind in (dq.F32_OUT, dq.BF16_OUT, dq.F16_OUT):
            specs.append(dq.DequantizeSpec(recipe, cw, out_kind != dq.F16_OUT, out_kind, path,
                                        0, aligned))
    for i, (path, recipe, cw, aligned) in enumerate((
            (dq.ROWS, dq.BLOCK1D, False, True), (dq.ROWS, dq.BLOCK2D, False, True),
            (dq.TILES, dq.BLOCK1D, True, True), (dq.TILES, dq.BLOCK2D, True, False))):
        out_kind = dq.BF16_OUT if i % 2 == 0 else dq.F16_OUT
        specs.append(dq.DequantizeSpec(recipe, cw, i % 3 != 1, out_kind, path, 4, aligned))
    for i, (recipe, cw) in enumerate(((dq.BLOCK1D, False), (dq.BLOCK1D, True),
                                      (dq.BLOCK2D, False), (dq.BLOCK2D, True),
                                      (dq.MXFP8, False), (dq.MXFP8, True))):
        specs.append(dq.DequantizeSpec(recipe, cw, i % 2 == 0, i % 3, dq.SCALAR))
    return specs


def _dq_id(spec):
    return (f"{spec.path}-{spec.recipe}-c{int(spec.columnwise)}-o{spec.out_kind}-"
            f"{'e4m3' if spec.e4m3 else 'e5m2'}-p{spec.piece}-a{int(spec.aligned)}")


def _key(spec):
    return "dequantize/" + _dq_id(spec)


for _spec in _dequant_specs():
    _ptx.case(_key(_spec), lambda s=_spec: (dk.make_kernel_pyfunc(s), dk.argtypes(s),
                                            dq.dequantize_launch_bounds(s)))


@pytest.mark.parametrize("spec", _dequant_specs(), ids=_dq_id)
def test_dequantize_kernel_compiles_for_sm90(spec):
    ptx = _ptx.ptx(_key(spec))       # compiled in the session's PTX job (tests/kernels/_ptx.py)
    assert ".target sm_90" in ptx
    assert not LOCAL.search(ptx), "registers spilled to local memory"
    assert "mul.ftz" not in ptx, "fp32 products must keep subnormals"
    if spec.path == dq.SCALAR:
        return
    fmt = "e4m3x2" if spec.e4m3 else "e5m2x2"
    assert f"cvt.rn.f16x2.{fmt}" in ptx, "hardware FP8 decoding"
    if spec.piece:
        assert "st.global.v2.u32" in ptx and "st.global.v4.u32" not in ptx, "8-byte stores"
    else:
        assert "st.global.v4.u32" in ptx, "16-byte stores"
    if spec.out_kind != dq.F32_OUT:
        half = "bf16x2" if spec.out_kind == dq.BF16_OUT else "f16x2"
        assert f"cvt.rn.{half}.f32" in ptx and f"set.nan.u32.{half}" in ptx
    if spec.path == dq.TILES:
        assert "ld.global.nc.v4.u32" in ptx and "bar.sync" in ptx and "prmt.b32" in ptx
    else:
        one_word = spec.out_kind == dq.F32_OUT or spec.piece == 4
        assert ("ld.global.nc.u32" if one_word else "ld.global.nc.v2.u32") in ptx
