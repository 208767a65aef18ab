"""Checks of the RMSNorm kernels' outputs (fp8blk/kernels/rms_norm.py), in NumPy, shared by
the simulator runner and the GPU tests. Each returns None or what is wrong.

Bounds (u32 = 2**-24, u_x the unit roundoff of x's dtype, D the width):
  * r: within (D + 8) u32 relative of the exact rsqrt(mean(x^2) + eps) (an fp32 sum of D
    squares in any order, the rsqrt.approx error, two roundings);
  * y: given the kernel's r, exactly ``w * (x * r)`` rounded as HF's formula rounds (an
    elementwise function of x, w and r: no freedom is left);
  * dx: within (u_x + (D + 8) u32) S + s_x / 2 of the exact gradient at the kernel's r, S = r
    (|g| + |h r| mean|g h r|), g = dy w (fp8blk/torch/norm.py states the same bound for its
    torch ops), s_x the smallest subnormal of x's dtype (the rounding of a subnormal dx);
  * dw (the partials' sum): within M u32 sum|p| of the exact sum of p = (dy * n) rounded to
    x's dtype, n = (x * r) rounded (fp32 adds of M terms in any grouping).
"""
from __future__ import annotations

import numpy as np

U32 = 2.0 ** -24
UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


def _r32(a, dtype):
    """float32 values rounded to `dtype` and back (float32 itself: unchanged)."""
    return np.asarray(a, np.float32).astype(dtype).astype(np.float32)


def _same_or_both_nan(a, b):
    a, b = np.asarray(a), np.asarray(b)
    fa, fb = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(fa) & np.isnan(fb)
    same = (a.view(np.uint8).reshape(a.shape + (-1,)) ==
            b.view(np.uint8).reshape(b.shape + (-1,))).all(-1)
    return same | nan


def check_forward(x, w, eps, y, r):
    """x (M, D), w (D,), y (M, D) in one dtype (NumPy, bf16 as ml_dtypes); r (M,) float32."""
    m, d = x.shape
    h = x.astype(np.float32)
    with np.errstate(all="ignore"):
        exact = 1.0 / np.sqrt((h.astype(np.float64) ** 2).mean(-1) + np.float64(np.float32(eps)))
        rel = np.abs(r.astype(np.float64) / exact - 1)
    bad = (rel > (d + 8) * U32) & np.isfinite(exact) & (exact > 0)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        return f"r[{i}] = {r[i]!r}, exact {exact[i]!r} (bound {(d + 8) * U32:.3g} relative)"
    with np.errstate(all="ignore"):
        n = _r32(h * r[:, None], x.dtype)
        want = (w.astype(np.float32)[None, :] * n).astype(x.dtype)
    ok = _same_or_both_nan(y, want)
    if not ok.all():
        i, j = np.argwhere(~ok)[0]
        return (f"y[{i}, {j}] = {y[i, j]!r}, the formula at the kernel's r gives "
                f"{want[i, j]!r} ({int((~ok).sum())} elements differ)")
    return None


def check_backward(x, w, dy, r, dx, dw_part):
    """x, dy, dx (M, D), w (D,) in one dtype; r (M,) float32; dw_part (P, D) float32."""
    m, d = x.shape
    ux = UNIT[np.dtype(x.dtype).name]
    h = x.astype(np.float64)
    rr = r.astype(np.float64)[:, None]
    g = dy.astype(np.float64) * w.astype(np.float64)[None, :]
    xhat = h * rr
    with np.errstate(all="ignore"):
        exact = rr * (g - xhat * (g * xhat).mean(-1, keepdims=True))
        s = rr * (np.abs(g) + np.abs(xhat) * np.abs(g * xhat).mean(-1, keepdims=True))
    err = np.abs(dx.astype(np.float64) - exact)
    import ml_dtypes

    info = ml_dtypes.finfo(x.dtype)
    big, tiny = float(info.max), float(info.smallest_subnormal)
    overflow = np.isinf(dx.astype(np.float64)) & (np.abs(exact) > big) \
        & (np.sign(dx.astype(np.float64)) == np.sign(exact))
    bound = (ux + (d + 8) * U32) * s + tiny / 2      # + half a subnormal step of x's dtype
    bad = ~(err <= bound) & np.isfinite(exact) & ~overflow
    if bad.any():
        i, j = np.argwhere(bad)[0]
        return (f"dx[{i}, {j}] = {dx[i, j]!r}, exact {exact[i, j]!r}, bound "
                f"{bound[i, j]!r} ({int(bad.sum())} elements outside)")
    with np.errstate(all="ignore"):
        n = _r32(x.astype(np.float32) * r[:, None], x.dtype)
        p = _r32(dy.astype(np.float32) * n, x.dtype).astype(np.float64)
    want = p.sum(0)
    got = dw_part.astype(np.float64).sum(0)
    bound = m * U32 * np.abs(p).sum(0)
    bad = ~(np.abs(got - want) <= bound) & np.isfinite(want)
    if bad.any():
        j = int(np.argwhere(bad)[0][0])
        return f"dw[{j}] = {got[j]!r}, exact {want[j]!r}, bound {bound[j]!r}"
    return None


def make_rows(rng, m, d, dtype, spread=3.0):
    """(M, D) values whose rows and columns span orders of magnitude (10^±spread by row,
    10^±1 by column), in `dtype`."""
    x = (rng.standard_normal((m, d)) * 10.0 ** rng.uniform(-spread, spread, (m, 1))
         * 10.0 ** rng.uniform(-1, 1, (1, d)))
    return x.astype(np.float32).astype(dtype)
