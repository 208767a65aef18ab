"""Every kernel compiles to PTX for compute capability 9.0 without a GPU, keeps its tile in
registers (no local-memory traffic), and uses the intended wide loads / FP8 conversions."""
import os
import re

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real Numba CUDA target, not the simulator",
                allow_module_level=True)

from fp8blk.kernels import _device as dev  # noqa: E402
from fp8blk.kernels import _quantize_kernel as qk  # noqa: E402
from fp8blk.kernels import dequant as dq  # noqa: E402
from fp8blk.kernels import transpose as tr  # noqa: E402
from fp8blk.kernels._numba import compile_ptx_sm90  # noqa: E402

LOCAL = re.compile(r"\b(ld|st)\.local\b")


def quant_spec(recipe, kind, rw, cw, e4m3=True, vec=True, col_vec=True, pow2=True, eps=0.0):
    return qk.QuantSpec(recipe=recipe, kind=kind, e4m3=e4m3, rowwise=rw, columnwise=cw,
                        pow2=pow2, eps=eps, vmax=3.0e38, vec=vec, col_vec=col_vec)


QUANT_SPECS = [
    quant_spec(r, k, rw, cw)
    for r in (qk.BLOCK1D, qk.BLOCK2D, qk.MXFP8)
    for rw, cw in ((True, False), (False, True), (True, True))
    for k in (dev.BF16, dev.F32)
] + [
    quant_spec(qk.BLOCK1D, dev.F16, True, True, e4m3=False, pow2=False, eps=1e-4),
    quant_spec(qk.BLOCK2D, dev.F16, True, True, e4m3=False),
    quant_spec(qk.MXFP8, dev.F16, True, True, e4m3=False),
    quant_spec(qk.BLOCK1D, dev.BF16, True, True, vec=False, col_vec=False),
    quant_spec(qk.BLOCK2D, dev.F32, True, True, vec=False, col_vec=False),
]


def _id(spec):
    return (f"{spec.recipe}-k{spec.kind}-r{int(spec.rowwise)}c{int(spec.columnwise)}"
            f"-{'e4m3' if spec.e4m3 else 'e5m2'}-v{int(spec.vec)}{int(spec.col_vec)}")


@pytest.mark.parametrize("spec", QUANT_SPECS, ids=_id)
def test_quantize_kernel_compiles_for_sm90(spec):
    ptx = compile_ptx_sm90(qk.make_kernel_pyfunc(spec), qk.argtypes(spec),
                           launch_bounds=qk.threads(spec))
    assert ".target sm_90" in ptx
    assert not LOCAL.search(ptx), "the tile spilled to local memory"
    fmt = "e4m3x2" if spec.e4m3 else "e5m2x2"
    assert f"cvt.rn.satfinite.{fmt}.f32" in ptx
    if spec.vec:
        assert "ld.global.nc.v4.u32" in ptx
    if spec.columnwise and spec.recipe != qk.MXFP8 and spec.col_vec:
        assert "st.global.v4.u32" in ptx


@pytest.mark.parametrize("vec_in,vec_out", [(True, True), (False, False), (True, False)])
def test_transpose_kernel_compiles_for_sm90(vec_in, vec_out):
    ptx = compile_ptx_sm90(tr.make_kernel_pyfunc(vec_in, vec_out), tr.argtypes(vec_in, vec_out),
                           launch_bounds=256)
    assert not LOCAL.search(ptx)
    assert "prmt.b32" in ptx
    if vec_in:
        assert "ld.global.nc.v4.u32" in ptx


@pytest.mark.parametrize("recipe", ["block1d", "block2d", "mxfp8"])
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("out_kind", [0, 1, 2])
def test_dequantize_kernel_compiles_for_sm90(recipe, columnwise, out_kind):
    e4m3 = out_kind != 2
    ptx = compile_ptx_sm90(dq.make_kernel_pyfunc(recipe, columnwise, e4m3, out_kind),
                           dq.argtypes(recipe, out_kind), launch_bounds=256)
    assert ".target sm_90" in ptx
    assert not LOCAL.search(ptx)
