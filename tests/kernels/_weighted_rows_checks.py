"""The weighted-rows kernel's NumPy formula and inputs (fp8blk/kernels/_weighted_rows_kernel.py
states it), shared by the simulator cases (sim_runner.py) and the CPU tests."""
from __future__ import annotations

import numpy as np


def rows_case(rng, tokens, top_k, width, rows, dtype):
    """(src (tokens, width) in `dtype`, w (tokens * top_k,) float32, pairs (rows,) int64): the
    pairs at random rows, the others padding; src spans orders of magnitude and holds +-0,
    inf and NaN in its first row; w holds a zero and a negative weight."""
    n = tokens * top_k
    src = rng.standard_normal((tokens, width)) * 10.0 ** rng.uniform(-3, 3, (tokens, 1))
    src = src.astype(np.float32)
    src[0, :4] = [0.0, -0.0, np.inf, np.nan][:width]
    w = rng.random(n).astype(np.float32)
    w[:2] = [0.0, -0.5][:n]
    pairs = np.full(rows, n, np.int64)
    pairs[rng.permutation(rows)[:n]] = np.arange(n)
    return src.astype(dtype), w, pairs


def rows_reference(src, w, pairs, top_k):
    """(rows, width) in src's dtype: ``src[pairs[r] // top_k] * w[pairs[r]]`` in float32,
    rounded once, -0 as +0, NaN as CUDA writes it (0x7FFF); zeros for a padding row."""
    n = w.shape[0]
    out = np.zeros((pairs.shape[0], src.shape[1]), np.float32)
    live = pairs < n
    with np.errstate(invalid="ignore"):
        out[live] = src[pairs[live] // top_k].astype(np.float32) * w[pairs[live], None]
    bits = out.astype(src.dtype).view(np.uint16).copy()
    bits[bits == 0x8000] = 0
    bits[np.isnan(out)] = 0x7FFF
    return bits.view(src.dtype)
