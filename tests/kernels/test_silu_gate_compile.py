"""The SiLU-gate kernels compile to PTX for compute capability 9.0 without a GPU: 16-byte loads
and stores, no local-memory traffic, IEEE divisions, and the one explicit fma of the backward
formula; the simulator cases' reference (tests/kernels/_silu_gate_checks.py) tells the
formula from a planted fault."""
import os
import re

import numpy as np
import pytest

from tests.kernels._silu_gate_checks import gate_reference, gate_rows

LOCAL = re.compile(r"\b(ld|st)\.local\b")
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(SIM, reason="compile_ptx needs the real Numba CUDA target")
@pytest.mark.parametrize("kind", [1, 2])
@pytest.mark.parametrize("backward", [False, True])
def test_silu_gate_kernels_compile_for_sm90(kind, backward):
    from fp8blk.kernels import _silu_gate_kernel as k
    from fp8blk.kernels import _specs as sp
    from fp8blk.kernels._numba import compile_ptx_sm90

    spec = sp.SiluGateSpec(kind, backward)
    pyfunc, argtypes, bounds = k.build(spec)
    ptx = compile_ptx_sm90(pyfunc, argtypes, launch_bounds=bounds)
    assert not LOCAL.search(ptx)
    assert ptx.count("ld.global.nc.v4.u32") == (3 if backward else 2)
    assert ptx.count("st.global.v4") == (2 if backward else 1)
    assert ptx.count("div.rn.f32") == 8                  # g / (1 + exp(-g)), per element
    # expf's range reduction holds 4 fma per call; the backward adds one per element
    assert ptx.count("fma.rn.f32") == 4 * 8 + (8 if backward else 0)


def test_reference_rejects_planted_faults():
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    g, u, dp = gate_rows(np.random.default_rng(0), 64, 64, bf)
    exp = lambda v: np.exp(v.astype(np.float64))  # noqa: E731
    want = gate_reference(g, u, dp, exp)
    f32 = np.float32
    g32, u32, d32 = (a.astype(f32) for a in (g, u, dp))
    with np.errstate(all="ignore"):
        s_unrounded = g32 / (f32(1) + exp(-g32).astype(f32))
        p_fault = (s_unrounded * u32).astype(bf)            # silu(g) not rounded first
        sig = f32(1) / (f32(1) + exp(-g32).astype(f32))
        t_unrounded = d32 * u32                             # dp * u not rounded first
        dg_fault = (t_unrounded * sig * (f32(1) + g32 * (f32(1) - sig))).astype(bf)
    same = lambda a, b: np.array_equal(a.view(np.uint16), b.view(np.uint16))  # noqa: E731
    assert same(want[0], want[0]) and not same(p_fault, want[0])
    assert not same(dg_fault, want[1])
