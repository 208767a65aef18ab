"""Every quantize kernel variant compiles to PTX for compute capability 9.0 without a GPU, keeps
its tile in registers (no local-memory traffic), and uses the intended wide loads / FP8
conversions."""
import os
import re

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real Numba CUDA target, not the simulator",
                allow_module_level=True)

from fp8blk.kernels import _quantize_kernel as qk  # noqa: E402
from fp8blk.kernels import _specs as sp  # noqa: E402

from . import _ptx  # noqa: E402

LOCAL = re.compile(r"\b(ld|st)\.local\b")


def quant_spec(recipe, kind, rw, cw, e4m3=True, vec=True, col_vec=True, pow2=True, eps=0.0):
    return sp.quantize_spec(recipe, kind, e4m3, rw, cw, pow2=pow2, eps=eps, vmax=3.0e38,
                            vec=vec, col_vec=col_vec)


QUANT_SPECS = [
    quant_spec(r, k, rw, cw)
    for r in (sp.BLOCK1D, sp.BLOCK2D, sp.MXFP8)
    for rw, cw in ((True, False), (False, True), (True, True))
    for k in (sp.BF16, sp.F32)
] + [
    quant_spec(sp.BLOCK1D, sp.F16, True, True, e4m3=False, pow2=False, eps=1e-4),
    quant_spec(sp.BLOCK2D, sp.F16, True, True, e4m3=False),
    quant_spec(sp.MXFP8, sp.F16, True, True, e4m3=False),
    quant_spec(sp.BLOCK1D, sp.BF16, True, True, vec=False, col_vec=False),
    quant_spec(sp.BLOCK2D, sp.F32, True, True, vec=False, col_vec=False),
]


def _id(spec):
    return (f"{spec.recipe}-k{spec.kind}-r{int(spec.rowwise)}c{int(spec.columnwise)}"
            f"-{'e4m3' if spec.e4m3 else 'e5m2'}-v{int(spec.vec)}{int(spec.col_vec)}")


def _key(spec):
    return "quantize/" + _id(spec)


for _spec in QUANT_SPECS:
    _ptx.case(_key(_spec), lambda s=_spec: (qk.make_kernel_pyfunc(s), qk.argtypes(s), s.threads))


@pytest.mark.parametrize("spec", QUANT_SPECS, ids=_id)
def test_quantize_kernel_compiles_for_sm90(spec):
    ptx = _ptx.ptx(_key(spec))       # compiled in the session's PTX job (tests/kernels/_ptx.py)
    assert ".target sm_90" in ptx
    assert not LOCAL.search(ptx), "the tile spilled to local memory"
    fmt = "e4m3x2" if spec.e4m3 else "e5m2x2"
    assert f"cvt.rn.satfinite.{fmt}.f32" in ptx
    if spec.vec:
        assert "ld.global.nc.v4.u32" in ptx
    if spec.columnwise and spec.recipe != sp.MXFP8 and spec.col_vec:
        assert "st.global.v4.u32" in ptx


# A Linear's groups (fp8blk/torch/linear/plans.py): forward x + W, backward dY + W's
# columnwise copy + a keep_input layer's x (the pair's kernel and the triple's)
GROUP_SPECS = [
    sp.quantize_group_spec([quant_spec(sp.BLOCK1D, sp.BF16, True, True),
                            quant_spec(sp.BLOCK2D, sp.BF16, True, False)]),
    sp.quantize_group_spec([quant_spec(sp.BLOCK1D, sp.BF16, True, True, e4m3=False),
                            quant_spec(sp.BLOCK2D, sp.BF16, False, True),
                            quant_spec(sp.BLOCK1D, sp.BF16, False, True, col_vec=False)]),
]


def _group_key(gspec):
    return "quantize_group/" + "+".join(_id(p) for p in gspec.parts)


for _g in GROUP_SPECS:
    _ptx.case(_group_key(_g), lambda g=_g: qk.build_group(g))


@pytest.mark.parametrize("gspec", GROUP_SPECS, ids=_group_key)
def test_quantize_group_kernel_compiles_for_sm90(gspec):
    """The group kernel compiles with its parts' tiles in registers, no subroutine call (a
    64-bit division would cap its registers at the call ABI's 64) and one set of shared
    arrays (the largest part's), not one per part."""
    ptx = _ptx.ptx(_group_key(gspec))
    assert ".target sm_90" in ptx
    assert not LOCAL.search(ptx), "the tile spilled to local memory"
    assert not re.search(r"\bcall(\.uni)?\b", re.sub(r"//.*", "", ptx)), "a subroutine call"
    shared = sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \w+\[(\d+)\]", ptx))
    assert shared == max(_shared_bytes(p) for p in gspec.parts), shared


def _shared_bytes(spec):
    sizes = qk.shared_shapes(spec)
    words = [sizes["red"], sizes["wred"], sizes["colred"][0] * sizes["colred"][1],
             sizes["colscale"], sizes["tb"][0] * sizes["tb"][1]]
    return 4 * sum(words)
