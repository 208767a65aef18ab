"""Builder of the weighted-rows kernel (launcher: ``weighted_rows``): the experts' padded rows
made from token rows, each scaled by its routed pair's weight -- the gradient the experts'
combine sends to the down projection's output rows (``fp8blk.torch.moe.grouped``).

    out[r] = src[pairs[r] // k] * w[pairs[r]]   where pairs[r] < P (a routed pair)
    out[r] = 0                                  where pairs[r] >= P (a padding row)

Per element the product of the two as fp32 (src's value and the weight), rounded once to the
rows' dtype, and -0 written as +0: torch's ``(g * w).to(dtype)`` of the expanded gradient,
then autograd's accumulating put into zeros (``0 + x``), byte for byte. A NaN is written as
CUDA's conversion writes it (0x7FFF), as torch's kernels do.

Rows of H elements are read as 16-byte chunks (8 elements): thread t of CTA b handles chunks
``(b * ITERS + i) * T + t``, i < ITERS. Arguments (pointers 16-byte aligned): ``src (T, H),
w (P,) fp32, pairs (R,) int64, out (R, H), R, C, k, P``, C = H / 8. Grid: cdiv(R * C, T *
ITERS) CTAs of T threads.
"""
from __future__ import annotations

from . import _specs as sp
from ._kernel_lib import chunk_of, torch_pair_codec
from ._numba import cuda, ld_v4_at, ptr, st_v4_at, types

T, ITERS = sp.ROWS_THREADS, sp.ROWS_ITERS


def make_kernel(spec):
    unpack, pack = torch_pair_codec(spec.kind)
    float32, uint32 = types.float32, types.uint32

    def kernel(src, w, pairs, out, R, C, k, P):
        zero = float32(0.0)
        words = cuda.local.array(4, uint32)
        for it in range(ITERS):
            inside, row, col = chunk_of(it, ITERS, T, R, C)
            if inside:
                pair = pairs[row]
                if pair < P:
                    s = w[pair]
                    a = ld_v4_at(src, ((pair // k) * C + col) * 16)
                    for q in range(4):
                        x0, x1 = unpack(a[q])
                        y0, y1 = x0 * s, x1 * s
                        # -0 -> +0 by a select (an added +0 could be fused into an fma)
                        words[q] = pack(y0 if y0 != zero else zero,
                                        y1 if y1 != zero else zero)
                else:
                    for q in range(4):
                        words[q] = uint32(0)
                st_v4_at(out, (row * C + col) * 16, words[0], words[1], words[2], words[3])

    return kernel


def argtypes(spec):
    i64 = types.int64
    return (ptr(types.uint32), ptr(types.float32), ptr(i64), ptr(types.uint32), i64, i64, i64,
            i64)


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.WeightedRowsSpec``."""
    return make_kernel(spec), argtypes(spec), T
