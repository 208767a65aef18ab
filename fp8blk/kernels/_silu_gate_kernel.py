"""Builder of the SiLU-gate kernels (launcher: ``silu_gate``): ``p = silu(g) * u`` forward and
its two input gradients, one pass each, with the bytes of torch's CUDA kernels for the same
ops in bf16 or fp16 (``F.silu(g) * u`` and autograd's backward of it).

Rows of I elements are read as 16-byte chunks (8 elements); each operand has its own row
stride, so g and u may be the two halves of one (M, 2I) buffer (the experts' gate/up output)
and dg, du the two halves of its gradient. Thread t of CTA b handles chunks ``(b * ITERS + i)
* T + t``, i < ITERS (a warp's 16-byte loads coalesce).

Per element, in fp32 (torch's opmath) with the roundings of torch's kernels:

    forward   s = g / (1 + exp(-g)), rounded      (F.silu: ActivationSiluKernel.cu)
              p = s * u, rounded                  (the product of two tensors)
    backward  du = dp * s, rounded                (MulBackward0: dp * silu(g))
              t = dp * u, rounded                 (MulBackward0: dp * u)
              sig = 1 / (1 + exp(-g))
              dg = t * sig * fma(g, 1 - sig, 1), rounded   (silu_backward; nvcc contracts
                                                  ``1 + g * (1 - sig)`` into one fma)

``exp`` is CUDA's expf (``_numba.exp_f32``); a NaN is written as CUDA's conversions write it
(0x7FFF), as torch's kernels do. Arguments (pointers 16-byte aligned, row strides
in bytes, multiples of 16): forward ``g, u, p, M, C, g_stride, u_stride, p_stride``; backward
``g, u, dp, dg, du, M, C, g_stride, u_stride, dp_stride, dg_stride, du_stride``, C = I / 8
chunks per row. Grid: cdiv(M * C, T * ITERS) CTAs of T threads.
"""
from __future__ import annotations

from . import _specs as sp
from ._kernel_lib import chunk_of, torch_pair_codec
from ._numba import cuda, exp_f32, fma_f32, ld_v4_at, ptr, st_v4_at, types

T, ITERS = sp.SILU_THREADS, sp.SILU_ITERS


def make_forward(spec):
    unpack, pack = torch_pair_codec(spec.kind)
    float32, uint32 = types.float32, types.uint32

    def kernel(g, u, p, M, C, gs, us, ps):
        one = float32(1.0)
        out = cuda.local.array(4, uint32)
        for it in range(ITERS):
            inside, row, col = chunk_of(it, ITERS, T, M, C)
            if inside:
                col *= 16
                gw = ld_v4_at(g, row * gs + col)
                uw = ld_v4_at(u, row * us + col)
                for q in range(4):
                    g0, g1 = unpack(gw[q])
                    u0, u1 = unpack(uw[q])
                    s0, s1 = unpack(pack(g0 / (one + exp_f32(-g0)),
                                         g1 / (one + exp_f32(-g1))))
                    out[q] = pack(s0 * u0, s1 * u1)
                st_v4_at(p, row * ps + col, out[0], out[1], out[2], out[3])

    return kernel


def make_backward(spec):
    unpack, pack = torch_pair_codec(spec.kind)
    float32, uint32 = types.float32, types.uint32

    def kernel(g, u, dp, dg, du, M, C, gs, us, dps, dgs, dus):
        one = float32(1.0)
        dga = cuda.local.array(4, uint32)
        dua = cuda.local.array(4, uint32)
        for it in range(ITERS):
            inside, row, col = chunk_of(it, ITERS, T, M, C)
            if inside:
                col *= 16
                gw = ld_v4_at(g, row * gs + col)
                uw = ld_v4_at(u, row * us + col)
                pw = ld_v4_at(dp, row * dps + col)
                for q in range(4):
                    g0, g1 = unpack(gw[q])
                    u0, u1 = unpack(uw[q])
                    d0, d1 = unpack(pw[q])
                    e0, e1 = one + exp_f32(-g0), one + exp_f32(-g1)
                    s0, s1 = unpack(pack(g0 / e0, g1 / e1))
                    dua[q] = pack(d0 * s0, d1 * s1)
                    t0, t1 = unpack(pack(d0 * u0, d1 * u1))
                    sg0, sg1 = one / e0, one / e1
                    dga[q] = pack(t0 * sg0 * fma_f32(g0, one - sg0, one),
                                  t1 * sg1 * fma_f32(g1, one - sg1, one))
                st_v4_at(du, row * dus + col, dua[0], dua[1], dua[2], dua[3])
                st_v4_at(dg, row * dgs + col, dga[0], dga[1], dga[2], dga[3])

    return kernel


def argtypes(spec):
    u32, i64 = ptr(types.uint32), types.int64
    if spec.backward:
        return (u32,) * 5 + (i64,) * 7
    return (u32,) * 3 + (i64,) * 5


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.SiluGateSpec``."""
    make = make_backward if spec.backward else make_forward
    return make(spec), argtypes(spec), T
