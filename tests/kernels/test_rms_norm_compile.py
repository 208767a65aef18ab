"""The RMSNorm kernels compile to PTX for compute capability 9.0 without a GPU: 16-byte loads
and stores, no local-memory traffic (the per-thread chunks stay in registers); and the checks
the simulator and GPU tests apply (tests/kernels/_rms_norm_checks.py) reject planted faults."""
import os
import re

import numpy as np
import pytest

from tests.kernels._rms_norm_checks import check_backward, check_forward, make_rows

LOCAL = re.compile(r"\b(ld|st)\.local\b")
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(SIM, reason="compile_ptx needs the real Numba CUDA target")
@pytest.mark.parametrize("kind,width", [(1, 4096), (1, 128), (0, 2048), (2, 16384)])
@pytest.mark.parametrize("backward", [False, True])
def test_rms_norm_kernels_compile_for_sm90(kind, width, backward):
    from fp8blk.kernels import _rms_norm_kernel as k
    from fp8blk.kernels import _specs as sp
    from fp8blk.kernels._numba import compile_ptx_sm90

    spec = sp.rms_norm_spec(kind, width, backward)
    ptx = compile_ptx_sm90(k.build(spec)[0], k.argtypes(spec), launch_bounds=spec.threads)
    assert not LOCAL.search(ptx)
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4" in ptx
    assert ("rsqrt.approx.f32" in ptx) != backward


def _exact_outputs(x, w, dy, eps):
    """Outputs a correct kernel could give (float64 math, rounded once), for the checks."""
    h = x.astype(np.float64)
    r = (1 / np.sqrt((h ** 2).mean(-1) + np.float32(eps))).astype(np.float32)
    n = (x.astype(np.float32) * r[:, None]).astype(x.dtype).astype(np.float32)
    y = (w.astype(np.float32) * n).astype(x.dtype)
    g = dy.astype(np.float64) * w.astype(np.float64)
    xh = h * r.astype(np.float64)[:, None]
    dx = (r.astype(np.float64)[:, None] * (g - xh * (g * xh).mean(-1, keepdims=True))
          ).astype(np.float32).astype(x.dtype)
    p = (dy.astype(np.float32) * n).astype(x.dtype).astype(np.float32)
    dw_part = np.stack([p[0::2].sum(0), p[1::2].sum(0)]).astype(np.float32)
    return y, r, dx, dw_part


def test_checks_accept_exact_outputs_and_reject_planted_faults():
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    x, dy = make_rows(rng, 40, 256, bf), make_rows(rng, 40, 256, bf, spread=2.0)
    w = (1 + 0.3 * rng.standard_normal(256)).astype(np.float32).astype(bf)
    y, r, dx, dw_part = _exact_outputs(x, w, dy, 1e-5)
    assert check_forward(x, w, 1e-5, y, r) is None
    assert check_backward(x, w, dy, r, dx, dw_part) is None
    bits = y.view(np.uint16).copy()
    bits[7, 3] ^= 1                                            # one ulp of one element
    assert "y[7, 3]" in check_forward(x, w, 1e-5, bits.view(bf), r)
    r2 = r.copy()
    r2[[4, 5]] = r2[[5, 4]]                                    # two rows' r swapped
    assert check_forward(x, w, 1e-5, y, r2).startswith("r[")
    dx2 = dx.copy()
    dx2[3] = -dx2[3]                                           # a row's gradient negated
    assert "dx[3," in check_backward(x, w, dy, r, dx2, dw_part)
    dw2 = dw_part.copy()
    dw2[:, [10, 11]] = dw2[:, [11, 10]]                        # two columns swapped
    assert "dw[" in check_backward(x, w, dy, r, dx, dw2)
