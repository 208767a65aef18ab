"""The weighted-rows kernel compiles to PTX for compute capability 9.0 without a GPU: 16-byte
loads and stores, no local-memory traffic, no fma (a fused +0 would keep a
-0); its reference (tests/kernels/_weighted_rows_checks.py) tells the formula from planted
faults."""
import os
import re

import numpy as np
import pytest

from tests.kernels._weighted_rows_checks import rows_case, rows_reference

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(SIM, reason="compile_ptx needs the real Numba CUDA target")
@pytest.mark.parametrize("kind", [1])
def test_weighted_rows_kernel_compiles_for_sm90(kind):
    from fp8blk.kernels import _specs as sp
    from fp8blk.kernels import _weighted_rows_kernel as k
    from fp8blk.kernels._numba import compile_ptx_sm90

    pyfunc, argtypes, bounds = k.build(sp.WeightedRowsSpec(kind))
    ptx = compile_ptx_sm90(pyfunc, argtypes, launch_bounds=bounds)
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4" in ptx
    assert "fma" not in ptx


def test_reference_rejects_planted_faults():
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    src, w, pairs = rows_case(np.random.default_rng(0), 7, 3, 24, 40, bf)
    want = rows_reference(src, w, pairs, 3).view(np.uint16)
    same = lambda a: np.array_equal(a.view(np.uint16), want)  # noqa: E731
    assert same(rows_reference(src, w, pairs, 3))
    assert not same(rows_reference(src[::-1].copy(), w, pairs, 3))     # the wrong token
    shifted = np.where(pairs < 21, (pairs + 1) % 21, pairs)
    assert not same(rows_reference(src, w, shifted, 3))                 # the wrong weight
    signed = rows_reference(src, w, pairs, 3).view(np.uint16).copy()
    signed[pairs == 0] |= np.uint16(0x8000) * (src[0] == 0)            # w[0] = 0: -0 kept
    assert not same(signed)
