"""Builder of the RMSNorm kernels (launcher: ``rms_norm``): Hugging Face's RMSNorm formula
(``fp8blk.torch.norm``) forward, and its gradient, one pass over the rows each.

A row of D elements is D / E 16-byte chunks (E = 8 for 2-byte dtypes, 4 for float32). A
group of TR threads (a power of two) owns a row, lane l reading chunks l, l + TR, ...
(`chunks` per thread, held in registers between the row's reduction and its use); a CTA of T
threads holds T / TR groups and walks ``iters`` rows per group: rows ``(block * iters + i) *
G + g``. A row's sum goes by xor shuffles within a warp (every lane ends with the same
bits), then, for a group wider than a warp, through shared memory in warp order: the result
does not depend on the launch, only on D.

Forward, per row: ``r = rsqrt(sum(h * h) * (1 / D) + eps)`` with h = x in fp32 (``rsqrt.approx``
as torch's rsqrt), then ``y = w * n`` with ``n = (h * r)`` rounded to x's dtype and the
product rounded once more: HF's ``weight * (x.float() * r).to(dtype)``. Writes y and r.

Backward, per row (g = dy * w in fp32): ``c = sum(g * h) * (1 / D) * (r * r)``, ``dx = (g - h
* c) * r`` rounded to x's dtype; and the weight's gradient ``dw[j] = sum over rows of p[j]``
with ``p = dy * n`` rounded to x's dtype (autograd's MulBackward of ``weight * n``): each
group adds its rows' p in fp32 and writes one row of fp32 partial sums, ``dw_part[(block * G
+ g), :]``, which the launcher's caller adds up (a fixed order: deterministic).

Arguments (pointers 16-byte aligned; scalars int64, floats as their fp32 bits):
forward ``x, w, y, r, M, D, iters, inv_d, eps``; backward ``x, w, dy, r, dx, dw_part, M, D,
iters, inv_d``. Grid: cdiv(M, G * iters) CTAs of T threads.
"""
from __future__ import annotations

from . import _specs as sp
from ._numba import (bf16x2_f32, bf16x2_pack, bits_f32, cuda, device, f16x2_f32, f16x2_pack,
                     f32_bits, ld_v4_at, ptr, rsqrt_f32, shfl_xor_f32, st_v4_at, types)


def _codec(kind):
    """(unpack(word) -> (a, b), pack(a, b) -> word, per-word element count) of a kind; for
    float32 a word is one element (b unused)."""
    if kind == sp.F32:
        @device
        def unpack(w):
            return bits_f32(w), bits_f32(w)

        @device
        def pack(a, b):
            return f32_bits(a)
        return unpack, pack, 1
    return ((bf16x2_f32, bf16x2_pack, 2) if kind == sp.BF16 else (f16x2_f32, f16x2_pack, 2))


def _group_sum(spec):
    """``sum(v, red, wsum, tid)``: the sum of `v` over this thread's row group, the same bits
    in every lane; every thread of the CTA calls it (a group wider than a warp syncs)."""
    TR = spec.row_threads
    lanes = min(TR, 32)
    wide = TR > 32
    per_group = TR // 32

    @device
    def group_sum(v, red, wsum, tid):
        m = 1
        while m < lanes:
            v = v + shfl_xor_f32(v, m, red, tid)
            m *= 2
        if wide:
            if tid % 32 == 0:
                wsum[tid // 32] = v
            cuda.syncthreads()
            w0 = (tid // TR) * per_group
            v = wsum[w0]
            for i in range(1, per_group):
                v = v + wsum[w0 + i]
            cuda.syncthreads()
        return v
    return group_sum


def _chunk_loader(spec):
    """``load(p, base, lane, nch, ok, out)``: this lane's chunks of one row into the uint32
    local array `out` (4 words per chunk; zeros where not `ok` or past the row's `nch`
    chunks); chunk c of the row is the 16 bytes at byte offset ``base + 16 c`` of `p`."""
    NC, TR = spec.chunks, spec.row_threads
    uint32 = types.uint32

    @device
    def load(p, base, lane, nch, ok, out):
        for j in range(NC):
            c = lane + TR * j
            if ok and c < nch:
                a0, a1, a2, a3 = ld_v4_at(p, base + c * 16)
            else:
                a0 = a1 = a2 = a3 = uint32(0)
            out[4 * j] = a0
            out[4 * j + 1] = a1
            out[4 * j + 2] = a2
            out[4 * j + 3] = a3
    return load


def make_forward(spec):
    NC, TR, T = spec.chunks, spec.row_threads, spec.threads
    G = T // TR
    E, IS = sp.ELEMS_PER_CHUNK[spec.kind], sp.ITEMSIZE[spec.kind]
    unpack, pack, P = _codec(spec.kind)
    two = P == 2
    group_sum = _group_sum(spec)
    load = _chunk_loader(spec)
    float32, uint32 = types.float32, types.uint32
    NW = max(T // 32, 1)
    L4 = NC * 4                  # local array lengths (compile-time constants)

    def kernel(x, w, y, r_out, M, D, iters, inv_d_bits, eps_bits):
        tid = cuda.threadIdx.x
        g = tid // TR
        lane = tid % TR
        red = cuda.shared.array(T, float32)          # simulator shuffle scratch
        wsum = cuda.shared.array(NW, float32)
        ww = cuda.local.array(L4, uint32)
        xw = cuda.local.array(L4, uint32)
        o = cuda.local.array(4, uint32)
        inv_d = bits_f32(inv_d_bits)
        eps = bits_f32(eps_bits)
        nch = D // E
        load(w, 0, lane, nch, True, ww)
        for it in range(iters):
            row = (cuda.blockIdx.x * iters + it) * G + g
            ok = row < M
            load(x, row * D * IS, lane, nch, ok, xw)
            ss = float32(0.0)
            for j in range(NC):
                for q in range(4):
                    h0, h1 = unpack(xw[4 * j + q])
                    ss = ss + h0 * h0
                    if two:
                        ss = ss + h1 * h1
            tot = group_sum(ss, red, wsum, tid)
            rr = rsqrt_f32(tot * inv_d + eps)
            if ok:
                if lane == 0:
                    r_out[row] = rr
                for j in range(NC):
                    c = lane + TR * j
                    if c < nch:
                        for q in range(4):
                            h0, h1 = unpack(xw[4 * j + q])
                            n0, n1 = unpack(pack(h0 * rr, h1 * rr))
                            w0, w1 = unpack(ww[4 * j + q])
                            o[q] = pack(w0 * n0, w1 * n1)
                        st_v4_at(y, (row * D + c * E) * IS, o[0], o[1], o[2], o[3])

    return kernel


def make_backward(spec):
    NC, TR, T = spec.chunks, spec.row_threads, spec.threads
    G = T // TR
    E, IS = sp.ELEMS_PER_CHUNK[spec.kind], sp.ITEMSIZE[spec.kind]
    unpack, pack, P = _codec(spec.kind)
    two = P == 2
    group_sum = _group_sum(spec)
    load = _chunk_loader(spec)
    float32, uint32 = types.float32, types.uint32
    NW = max(T // 32, 1)
    L4, L8 = NC * 4, NC * 8      # local array lengths (compile-time constants)

    def kernel(x, w, dy, r, dx, dw_part, M, D, iters, inv_d_bits):
        tid = cuda.threadIdx.x
        g = tid // TR
        lane = tid % TR
        red = cuda.shared.array(T, float32)          # simulator shuffle scratch
        wsum = cuda.shared.array(NW, float32)
        ww = cuda.local.array(L4, uint32)
        xw = cuda.local.array(L4, uint32)
        gw = cuda.local.array(L4, uint32)
        acc = cuda.local.array(L8, float32)      # dw partials, 2 per word
        o = cuda.local.array(4, uint32)
        inv_d = bits_f32(inv_d_bits)
        nch = D // E
        load(w, 0, lane, nch, True, ww)
        for i in range(NC * 8):
            acc[i] = float32(0.0)
        for it in range(iters):
            row = (cuda.blockIdx.x * iters + it) * G + g
            ok = row < M
            rr = r[row] if ok else float32(0.0)
            load(x, row * D * IS, lane, nch, ok, xw)
            load(dy, row * D * IS, lane, nch, ok, gw)
            s = float32(0.0)
            for j in range(NC):
                for q in range(4):
                    h0, h1 = unpack(xw[4 * j + q])
                    d0, d1 = unpack(gw[4 * j + q])
                    w0, w1 = unpack(ww[4 * j + q])
                    s = s + (d0 * w0) * h0
                    if two:
                        s = s + (d1 * w1) * h1
            tot = group_sum(s, red, wsum, tid)
            cc = (tot * inv_d) * (rr * rr)
            if ok:
                for j in range(NC):
                    c = lane + TR * j
                    if c < nch:
                        for q in range(4):
                            h0, h1 = unpack(xw[4 * j + q])
                            d0, d1 = unpack(gw[4 * j + q])
                            w0, w1 = unpack(ww[4 * j + q])
                            o[q] = pack(((d0 * w0) - h0 * cc) * rr, ((d1 * w1) - h1 * cc) * rr)
                            n0, n1 = unpack(pack(h0 * rr, h1 * rr))
                            p0, p1 = unpack(pack(d0 * n0, d1 * n1))
                            k = 8 * j + 2 * q
                            acc[k] = acc[k] + p0
                            if two:
                                acc[k + 1] = acc[k + 1] + p1
                        st_v4_at(dx, (row * D + c * E) * IS, o[0], o[1], o[2], o[3])
        prow = (cuda.blockIdx.x * G + g) * D
        for j in range(NC):
            c = lane + TR * j
            if c < nch:
                for q in range(E // 4):
                    # 4 fp32 partials = 16 bytes: elements c * E + 4 q .. + 3
                    if two:
                        v0, v1 = acc[8 * j + 4 * q], acc[8 * j + 4 * q + 1]
                        v2, v3 = acc[8 * j + 4 * q + 2], acc[8 * j + 4 * q + 3]
                    else:
                        v0, v1, v2, v3 = (acc[8 * j], acc[8 * j + 2], acc[8 * j + 4],
                                          acc[8 * j + 6])
                    st_v4_at(dw_part, (prow + c * E + 4 * q) * 4, f32_bits(v0),
                             f32_bits(v1), f32_bits(v2), f32_bits(v3))

    return kernel


def argtypes(spec):
    u32, f32, i64 = ptr(types.uint32), ptr(types.float32), types.int64
    if spec.backward:
        return (u32, u32, u32, f32, u32, u32, i64, i64, i64, i64)
    return (u32, u32, u32, f32, i64, i64, i64, i64, i64)


def build(spec):
    """(pyfunc, argtypes, launch_bounds) of the kernel for a ``_specs.RMSNormSpec``."""
    make = make_backward if spec.backward else make_forward
    return make(spec), argtypes(spec), spec.threads
