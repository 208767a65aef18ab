"""The SiLU gate's NumPy formula and inputs, shared by the simulator cases (sim_runner.py) and
the CPU tests: torch's CUDA kernels' arithmetic for ``F.silu(g) * u`` and autograd's backward
of it (fp8blk/kernels/_silu_gate_kernel.py states it), with the exponential supplied."""
from __future__ import annotations

import numpy as np


def gate_rows(rng, m, i, dtype):
    """(g, u, dp) (m, i) in `dtype`: rows and columns spanning orders of magnitude; g holds
    +-inf, NaN, +-0 and values past exp's float32 range (|g| > 88) where the shape allows."""
    def rows(spread):
        x = rng.standard_normal((m, i)) * 10.0 ** rng.uniform(-spread, spread, (m, 1))
        return (x * 10.0 ** rng.uniform(-1, 1, (1, i))).astype(np.float32)
    g, u, dp = rows(1.5), rows(1.0), rows(2.0)
    specials = [np.inf, -np.inf, np.nan, 0.0, -0.0, 95.0, -95.0, -20.0]
    flat = g.reshape(-1)
    flat[:min(len(specials), flat.size)] = specials[:flat.size]
    return tuple(a.astype(dtype) for a in (g, u, dp))


def gate_reference(g, u, dp, exp):
    """(p, dg, du) in g's dtype: the kernels' formula in float32 with ``exp(x)`` (float32 in,
    any float out) rounded once to float32."""
    dt = g.dtype
    f32 = np.float32
    g32, u32, d32 = (a.astype(f32) for a in (g, u, dp))
    with np.errstate(all="ignore"):
        e = f32(1) + exp(-g32).astype(f32)
        s = (g32 / e).astype(dt).astype(f32)
        p = (s * u32).astype(dt)
        du = (d32 * s).astype(dt)
        t = (d32 * u32).astype(dt).astype(f32)
        sig = f32(1) / e
        f = (g32.astype(np.float64) * (f32(1) - sig).astype(np.float64) + 1).astype(f32)
        dg = ((t * sig) * f).astype(dt)
    return tuple(_quiet(a) for a in (p, dg, du))




def _quiet(a):
    """NaN as torch's CUDA kernels write it: CUDA's conversion of the canonical NaN, 0x7FFF
    (NumPy keeps the sign and payload of the platform's NaN)."""
    bits = a.view(np.uint16).copy()
    bits[np.isnan(a.astype(np.float32))] = 0x7FFF
    return bits.view(a.dtype)
