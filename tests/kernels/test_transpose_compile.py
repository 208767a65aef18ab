"""The transpose kernel compiles to PTX for compute capability 9.0 without a GPU, without
local-memory traffic, with byte permutes and (aligned rows) 16-byte loads."""
import os
import re

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real Numba CUDA target, not the simulator",
                allow_module_level=True)

from fp8blk.kernels import _transpose_kernel as tr  # noqa: E402
from fp8blk.kernels._numba import compile_ptx_sm90  # noqa: E402

LOCAL = re.compile(r"\b(ld|st)\.local\b")


@pytest.mark.parametrize("vec_in,vec_out", [(True, True), (False, False), (True, False)])
def test_transpose_kernel_compiles_for_sm90(vec_in, vec_out):
    ptx = compile_ptx_sm90(tr.make_kernel_pyfunc(vec_in, vec_out), tr.argtypes(vec_in, vec_out),
                           launch_bounds=256)
    assert not LOCAL.search(ptx)
    assert "prmt.b32" in ptx
    if vec_in:
        assert "ld.global.nc.v4.u32" in ptx
