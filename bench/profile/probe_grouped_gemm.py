"""Can one Numba WGMMA launch run the experts' m-grouped forward GEMM (x 1x128 with W_e
128x128, every expert at once, the segment table read on the device), and how fast?

Why: fp8blk's experts path (``fp8blk.torch.moe``) runs each expert's GEMM through cuBLASLt,
which needs the segment table on the host and costs host time per expert: level with bf16
``grouped_mm`` at Mixtral's 8 experts, host-bound at Qwen3-30B-A3B's 128
(``bench/results/moe-h200.json``). This probe builds the one-launch kernel on the WGMMA
foundations of ``probe_wgmma.py`` and measures it against bf16 ``grouped_mm`` and the
per-expert cuBLASLt loop, operands already quantized.

Kernel: a CTA computes a 128 x 128 tile of y (two warpgroups of 64 rows, wgmma m64n128k32,
e4m3, operands K-major in shared memory without swizzle, the layout ``probe_wgmma`` checked).
The padded token layout puts every 128-row tile inside one expert; ``tile_expert`` (one int32
per row tile, computed on the device by ``torch.searchsorted``) says which, and a tile past the
last segment writes zeros. Per 128-deep block of K: the A and B tiles arrive by ``cp.async``
16-byte copies in a 5-stage ring (dynamic shared memory, 160 KiB); CTAs run in a grouped
raster order (8 row tiles by every column tile) so that the tiles the running CTAs read stay
in L2, four wgmma into a fresh
partial, then ``final += part * sa[row, kb] * sb_e[tile, kb]`` (the 1x128 x 128x128
promotion); the epilogue packs pairs of bf16 (``cvt.rn.bf16x2.f32``, round to nearest even).
Needs K and N multiples of 128.

Result on the H200 (2026-12-04, ``results/probe-grouped-gemm-h200.json``): every check equal
to cuBLASLt's bytes, 177-257 TFLOP/s (0.31-0.38x bf16 ``grouped_mm``; the per-expert cuBLASLt
loop 922-1140 at Mixtral's shapes, 22-76 at Qwen3's). ``--parts`` at the gate/up shapes,
balanced: without the copies 758 (Mixtral) / 439 (Qwen3) TFLOP/s, without the promotion
333 / 265: the copies, not the tensor cores or the promotion, bound this kernel. Nsight
Compute at Qwen3's gate/up shape (``--profile qwen3_30b_gate_up``, one launch): L2 throughput
80.5% of peak at a 91.4% hit rate, DRAM 8.6%, 0.16 instructions issued per scheduler and
cycle, half the stalls on L1TEX scoreboards (the copies' waits and the per-block scale
loads): at 128 x 128 tiles every CTA pulls its A and B tiles through L2 on its own. TMA
bulk-tensor copies multicast to the CTAs of a cluster that share a tile (halving L2 reads),
with the scales prefetched a block ahead, are the next step.

Checks: against blockwise_scaled_mm per expert on the same operands (cuBLASLt sums in
another order: the bound is the fp32 accumulation's, a bf16 rounding step at most), balanced,
skewed (empty experts) and tiny routings. Timing: CUDA events, median of interleaved repeats.

    python3 -m bench.profile.probe_grouped_gemm [--out F.json]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys

import numpy as np

from fp8blk.kernels import _numba as nb

cuda, types = nb.cuda, nb.types

if nb.SIM:
    sys.exit("probe_grouped_gemm needs a GPU (NUMBA_ENABLE_CUDASIM is set)")

from llvmlite import ir  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

from bench.bench_moe import SHAPES  # noqa: E402
from bench.profile.probe_wgmma import (block_issue, fence_proxy_async,  # noqa: E402
                                       inline_asm, void_asm, wgmma_ops)

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()

STAGES = 5
GROUP = 8                  # row tiles per raster group: concurrent CTAs share A and B in L2
STAGE_BYTES = 32768        # A: 128 rows x 128 bytes, B: 128 rows x 128 bytes
THREADS = 256

cp_async_commit = void_asm("cp.async.commit_group;")
cp_async_wait_ring = void_asm(f"cp.async.wait_group {STAGES - 2};")
cp_async_wait0 = void_asm("cp.async.wait_group 0;")


@intrinsic
def cp_async16(typingctx, smem_addr, ptr, offset):
    """cp.async.cg of 16 bytes from ptr + offset (bytes) to the shared address smem_addr."""
    def codegen(context, builder, sig, args):
        src = builder.ptrtoint(builder.gep(args[1], [args[2]]), _I64)
        dst = args[0] if args[0].type.width == 32 else builder.trunc(args[0], _I32)
        inline_asm(builder, ir.VoidType(), [dst, src], "cp.async.cg.shared.global [$0], [$1], 16;",
                   "r,l,~{memory}")
        return context.get_dummy_value()
    return types.void(smem_addr, ptr, offset), codegen


@functools.lru_cache(maxsize=None)
def store_ops(n=128):
    n_acc = n // 2
    acc_t = types.UniTuple(types.float32, n_acc)

    @intrinsic
    def store_bf16(typingctx, c, row, col, ld_words, acc):
        """The thread's 64 x n fragment (rows row, row + 8; columns col + 8j, + 1) as bf16 pairs
        into c (uint32 words, ld_words per row): cvt.rn.bf16x2.f32 packs column col + 8j in the
        low half (the lower address)."""
        def codegen(context, builder, sig, args):
            cp, r0, cl, ld = args[0], args[1], args[2], args[3]
            vals = [builder.extract_value(args[4], i) for i in range(n_acc)]
            for j in range(n_acc // 4):
                for half in range(2):
                    lo, hi = vals[4 * j + 2 * half], vals[4 * j + 2 * half + 1]
                    word = inline_asm(builder, _I32, [hi, lo], "cvt.rn.bf16x2.f32 $0, $1, $2;",
                                      "=r,f,f")
                    r = builder.add(r0, ir.Constant(r0.type, 8 * half))
                    w = builder.add(builder.sdiv(cl, ir.Constant(cl.type, 2)),
                                    ir.Constant(cl.type, 4 * j))
                    idx = builder.add(builder.mul(r, ld), w)
                    builder.store(word, builder.gep(cp, [idx]))
            return context.get_dummy_value()
        return types.void(c, row, col, ld_words, acc_t), codegen

    return store_bf16


MODES = ("full", "noload", "nopromote")


def make_kernel(mode="full"):
    """``mode``: "full" (the GEMM); for the timing of its parts (wrong results) "noload"
    (the ring filled once, the loop without copies or their waits) and "nopromote" (every
    block accumulated into one accumulator, waited for once at the end)."""
    o = wgmma_ops(128)
    zeros, wait0, wait1, promote_rows, shared_addr = (
        o.zeros, o.wait0, o.wait1, o.promote_rows, o.shared_addr)
    store_bf16 = store_ops(128)

    issue = block_issue(128)

    @nb.device
    def load(base, stage, a, b, a_row0, b_row0, k, kb, tid):
        """Block kb of the A tile (128 rows from a_row0) and the B tile (128 rows from
        b_row0, the expert's rows of W) into ring stage `stage`: chunk i of 16 bytes goes to
        byte 16 i of the tile, the core-matrix layout (rows in groups of 8, K in 16-byte
        columns 128 bytes apart, row groups 1024 apart)."""
        sbase = base + stage * STAGE_BYTES
        for j in range(4):
            i = tid + THREADS * j
            w = i // 512
            rem = i % 512
            row = w * 64 + (rem // 64) * 8 + rem % 8
            chunk = (rem % 64) // 8
            cp_async16(np.uint32(sbase + i * 16), a,
                       np.int64(a_row0 + row) * k + kb * 128 + chunk * 16)
            row = (i // 64) * 8 + i % 8
            chunk = (i % 64) // 8
            cp_async16(np.uint32(sbase + 16384 + i * 16), b,
                       np.int64(b_row0 + row) * k + kb * 128 + chunk * 16)

    def kernel(a, b, sa, sb, c, tile_expert, rows, n, k, experts, kbp, lbo, sbo):
        smem = cuda.shared.array(0, types.uint8)
        tid = cuda.threadIdx.x
        wg = tid // 128
        t = tid % 128
        lane = t % 32
        row0 = (t // 32) * 16 + lane // 4
        col = 2 * (lane % 4)
        # grouped raster order: GROUP row tiles x every column tile, row tiles fastest
        pid = np.int64(cuda.blockIdx.x)
        n_tiles = n // 128
        m_tiles = rows // 128
        group = pid // (GROUP * n_tiles)
        first = group * GROUP
        size = min(m_tiles - first, GROUP)
        mt = first + (pid % (GROUP * n_tiles)) % size
        nt = (pid % (GROUP * n_tiles)) // size
        e = tile_expert[mt]
        out_row = mt * 128 + wg * 64 + row0
        if e >= experts:                       # past the last segment: zeros
            store_bf16(c, out_row, nt * 128 + col, n // 2, zeros())
            return
        raw = np.int64(shared_addr(smem))
        base = ((raw + 127) // 128) * 128
        kb_count = k // 128
        a_row0 = mt * 128
        b_row0 = np.int64(e) * n + nt * 128
        for s in range(STAGES - 1):
            if s < kb_count:
                load(base, s, a, b, a_row0, b_row0, k, s, tid)
            cp_async_commit()
        hi = (np.uint64(lbo >> 4) << np.uint64(16)) | (np.uint64(sbo >> 4) << np.uint64(32))
        final = zeros()
        part = zeros()
        sb_row = (np.int64(e) * (n // 128) + nt) * kbp
        if mode == "noload":
            cp_async_wait0()
            fence_proxy_async()
            cuda.syncthreads()
        for kb in range(kb_count):
            if mode != "noload":
                cp_async_wait_ring()
                fence_proxy_async()
                cuda.syncthreads()
                nxt = kb + STAGES - 1
                if nxt < kb_count:
                    load(base, nxt % STAGES, a, b, a_row0, b_row0, k, nxt, tid)
                cp_async_commit()
            sbase = base + (kb % (STAGES if mode != "noload" else STAGES - 1)) * STAGE_BYTES
            da = np.uint64(((sbase + wg * 8192) & 0x3FFFF) >> 4) | hi
            db = np.uint64(((sbase + 16384) & 0x3FFFF) >> 4) | hi
            if mode == "nopromote":
                final = issue(final, da, db, 1)
                final = wait1(final)
            else:
                part = issue(part, da, db, 0)
                sbk = sb[sb_row + kb]
                r0 = sa[np.int64(kb) * rows + out_row] * sbk
                r1 = sa[np.int64(kb) * rows + out_row + 8] * sbk
                part = wait0(part)
                final = promote_rows(final, part, r0, r1)
        if mode == "nopromote":
            final = wait0(final)
        cp_async_wait0()
        store_bf16(c, out_row, nt * 128 + col, n // 2, final)

    return kernel


ARGTYPES = [nb.ptr(types.uint8), nb.ptr(types.uint8), nb.ptr(types.float32),
            nb.ptr(types.float32), nb.ptr(types.uint32), nb.ptr(types.int32), types.int64,
            types.int64, types.int64, types.int64, types.int64, types.int64, types.int64]
SMEM = STAGES * STAGE_BYTES + 128


@functools.lru_cache(maxsize=None)
def kernel(mode="full"):
    import cupy
    f = nb.compile_kernel(make_kernel(mode), ARGTYPES, launch_bounds=(THREADS, 1))
    cupy.cuda.driver.funcSetAttribute(
        f.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM)
    return f


def tile_experts(routing):
    """(rows/128,) int32: the expert of each 128-row tile, E past the last segment."""
    import torch
    ends = torch.cumsum(routing.padded, 0) // 128
    tiles = torch.arange(routing.rows // 128, device=ends.device)
    return torch.searchsorted(ends, tiles, right=True).to(torch.int32)


def grouped_forward(a, a_scale, b, b_scale, tiles, experts, mode="full"):
    """y (rows, N) bf16 = the m-grouped GEMM of a (rows, K) e4m3 with 1x128 scales
    (K/128, rows) and b (E, N, K) e4m3 with per-expert 128x128 scales (E, N/128, kbp)."""
    import cupy
    import torch
    rows, k = a.shape
    n = b.shape[1]
    c = torch.empty((rows, n), dtype=torch.bfloat16, device=a.device)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        kernel(mode)(((n // 128) * (rows // 128),), (THREADS,),
                 (np.uint64(a.data_ptr()), np.uint64(b.data_ptr()),
                  np.uint64(a_scale.data_ptr()), np.uint64(b_scale.data_ptr()),
                  np.uint64(c.data_ptr()), np.uint64(tiles.data_ptr()), np.int64(rows),
                  np.int64(n), np.int64(k), np.int64(experts), np.int64(b_scale.shape[2]),
                  np.int64(128), np.int64(1024)), shared_mem=SMEM)
    return c


def operands(experts, top_k, tokens, k, n, kind, seed=0):
    import torch

    from fp8blk.torch import Float8BlockConfig
    from fp8blk.torch.linear.functional import quantize_buffers
    from fp8blk.torch.moe import permute, route
    from fp8blk.torch.moe.gemms import expert_weight_buffers
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if kind == "skewed":
        scores[:, experts - max(1, experts // 4):] = -1
        scores[:, 0] = 2
    ids = scores.argsort(1, descending=True)[:, :top_k].cuda()
    r = route(ids, experts)
    x = torch.randn(tokens, k, generator=gen).to("cuda", torch.bfloat16)
    x = x * torch.logspace(-2, 2, tokens, device="cuda").to(torch.bfloat16).unsqueeze(1)
    w = (torch.randn(experts, n, k, generator=gen) * k ** -0.5).to("cuda", torch.bfloat16)
    cfg = Float8BlockConfig()
    qx = quantize_buffers(permute(x, r), cfg.activation, True, False)
    wd, ws = expert_weight_buffers(w, cfg.weight, False, True)
    return r, qx[0].view(torch.float8_e4m3fn), qx[1], wd, ws, x, w


def check(experts, top_k, tokens, k, n, kind):
    import torch

    from fp8blk.torch.moe.gemms import grouped_mm_rows
    r, a, sa, b, sb, _, _ = operands(experts, top_k, tokens, k, n, kind)
    got = grouped_forward(a, sa, b, sb, tile_experts(r), experts)
    ref = grouped_mm_rows(a, sa, b, sb, r, torch.bfloat16)
    torch.cuda.synchronize()
    g, f = got.float(), ref.float()
    diff = (g - f).abs()
    # one bf16 rounding step of the larger, or fp32 noise where the sum cancels
    tol = torch.maximum(g.abs(), f.abs()) * 2.0 ** -7 + f.abs().max() * 2.0 ** -14
    return dict(kind=kind, experts=experts, tokens=tokens, k=k, n=n,
                equal_fraction=float((got == ref).float().mean()),
                within_bound=bool((diff <= tol).all()), max_abs=float(diff.max()),
                nan=bool(torch.isnan(g).any()))


def timing(name, experts, top_k, tokens, k, n, kind, modes=()):
    import torch

    from bench.bench_linear import interleaved_ms
    from bench.bench_moe import bf16_grouped_mm, sorted_rows
    from fp8blk.torch.moe import permute
    from fp8blk.torch.moe.gemms import grouped_mm_rows
    r, a, sa, b, sb, x, w = operands(experts, top_k, tokens, k, n, kind)
    tiles = tile_experts(r)
    r.host()
    xs, offs = sorted_rows(permute(x, r), r)
    gmm = bf16_grouped_mm()
    wt = w.transpose(-2, -1)
    fns = {"bf16": lambda: gmm(xs, wt, offs=offs),
           "cublaslt_loop": lambda: grouped_mm_rows(a, sa, b, sb, r, torch.bfloat16),
           "wgmma": lambda: grouped_forward(a, sa, b, sb, tiles, experts)}
    for mode in modes:
        fns[f"wgmma_{mode}"] = functools.partial(grouped_forward, a, sa, b, sb, tiles, experts,
                                                 mode)
    ms = interleaved_ms(fns, inner=5, repeats=5, warmup=2)
    flop = 2.0 * tokens * top_k * k * n
    return dict(shape=name, routing=kind, **{f"{v}_tflops": round(flop / t / 1e9, 1)
                                              for v, t in ms.items()},
                ratio_vs_bf16=round(ms["bf16"] / ms["wgmma"], 3))


def main():
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--checks-only", action="store_true")
    ap.add_argument("--parts", action="store_true",
                    help="also time the kernel without its loads and without its promotion")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--routings", default="balanced,skewed")
    ap.add_argument("--profile", metavar="SHAPE",
                    help="only launch the kernel at SHAPE, balanced, 3 times (for Nsight Compute)")
    args = ap.parse_args()
    res = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "command": "python3 " + " ".join(sys.argv),
           "checks": [], "timing": []}
    if args.profile:
        r, a, sa, b, sb, _, _ = operands(*SHAPES[args.profile], "balanced")
        tiles = tile_experts(r)
        for _ in range(3):
            grouped_forward(a, sa, b, sb, tiles, SHAPES[args.profile][0])
        torch.cuda.synchronize()
        return
    for case in [(8, 2, 1000, 512, 768, "balanced"), (8, 2, 1000, 512, 768, "skewed"),
                 (16, 4, 9, 256, 384, "balanced"), (6, 3, 700, 640, 256, "skewed")]:
        out = check(*case)
        res["checks"].append(out)
        print("check", out, flush=True)
    if not args.checks_only:
        for name in args.shapes.split(","):
            for kind in args.routings.split(","):
                out = timing(name, *SHAPES[name], kind,
                             modes=("noload", "nopromote") if args.parts else ())
                res["timing"].append(out)
                print(out, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
