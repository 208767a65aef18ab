"""The one-launch grouped GEMMs (``fp8blk.kernels.grouped_gemm``) alone, operands already
quantized, against bf16 ``grouped_mm`` and the per-expert cuBLASLt loops they replace: TFLOP/s
at the Mixtral-8x7B and Qwen3-30B-A3B expert shapes, balanced and skewed routing, after checks
on small routings (the m-grouped kernel against the loop's bytes, the k-grouped within a bf16
rounding step).

What the m-grouped kernel's design steps measured (H200, forward at the four shapes, operands
as here): a first form whose 256 threads copied the tiles with ``cp.async`` and met at a CTA
barrier per 128-deep block ran 177-257 TFLOP/s, bound by the copies. With the copies on the
tensor memory accelerator (a producer warpgroup, ``mbarrier`` rings, 128-byte swizzle) and a
persistent grid: 560-618 (Mixtral), 323-513 (Qwen3). With the A tile's row scales copied in
beside it and the B scale read a block ahead (no global loads on the math warps' path):
903-972 / 445-697. With the output staged through shared memory (``stmatrix``, 16-byte rows out
instead of 4-byte words; ``setmaxnreg`` 40/232 to hold the staging without spills): 914-984 /
656-908 in that run. The same kernel's figures moved by up to 12% between runs; the results
file's run (the library kernel, all three GEMMs) is the reference.

Wider output tiles do not pay. Nsight Compute on the forward kernel at Mixtral's gate/up
shape (the library kernel, 128 x 128 tiles): L2 throughput 79%, SM throughput 64%, issue
slots 43%, 0.56 eligible warps per scheduler (9 resident). A 128 x 192 variant (wgmma
m64n192k32, 18% fewer L2 bytes per FLOP, a 4-stage ring of 40 KB stages, the tile's columns
straddling two 128-column weight-scale blocks; ptxas spilled 40 bytes at 232 registers), the
same bytes as the loop, against the library kernel in the same two runs, TFLOP/s: Mixtral
gate/up fwd 906-911 vs 927-953, dgrad 895-908 vs 954-975; down fwd 912-924 vs 973-990;
Qwen3 gate/up fwd 862-872 vs 844-854, down fwd 673-686 vs 641-670. Not kept.

Nor does sharing A across a cluster (commit 1bcb5fc, reverted): clusters of two CTAs on the
column tiles (mt, 2j) and (mt, 2j + 1), each producer multicasting a 64-row half of the A tile
into both CTAs, a stage refilled once both CTAs' math warps released it. The same bytes as
the loop; forward TFLOP/s in one run, paired vs the library kernel interleaved: Mixtral
gate/up 886-906 vs 861-951, Qwen3 gate/up 804-812 vs 835-840. Under Nsight Compute (1.36 GHz)
L2 throughput fell from 79% to 54% while SM throughput stayed at 61-64%: the math
warpgroups' wait-then-promote loop bounds the kernel, not L2. Two details cost 2x before
they were fixed there: a cluster-scope release on the remote arrival (it waits for the
thread's in-flight B-scale load) and idle producer lanes parked at an exit cluster barrier.
Loading the next tile's expert and first B scale (and, in the k-grouped kernel, the next
segment's length) during the current tile instead of at its start: the same bytes, TFLOP/s
new vs old interleaved in one run: Mixtral fwd +0-5%, dgrad -3 to +4%, wgrad -8 to -14%;
Qwen3 -2 to -6% on all three. Not kept: the latency at a tile boundary is not what bounds it.

    python3 -m bench.profile.probe_grouped_tma [--out F.json] [--shapes S,..] [--checks-only]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys


def _with(policy, fn, *args):
    from fp8blk.kernels import grouped_gemm
    prev = grouped_gemm.set_policy(policy)
    try:
        return fn(*args)
    finally:
        grouped_gemm.set_policy(prev)


def _loop(fn, *args):
    return _with("never", fn, *args)


def _kernel(fn, *args):
    return _with("always", fn, *args)


def operands(experts, top_k, tokens, k, n, kind, seed=0):
    """The routing and the quantized operands of the three GEMMs (bench.bench_moe's data)."""
    import torch

    from bench.bench_moe import routing_ids
    from fp8blk.torch import Float8BlockConfig
    from fp8blk.torch.linear.functional import quantize_buffers
    from fp8blk.torch.moe import permute, route
    from fp8blk.torch.moe.gemms import expert_weight_buffers
    gen = torch.Generator().manual_seed(seed)
    r = route(routing_ids(tokens, top_k, experts, kind == "skewed", gen).cuda(), experts)
    x = torch.randn(tokens, k, generator=gen).to("cuda", torch.bfloat16)
    x = x * torch.logspace(-2, 2, tokens, device="cuda").to(torch.bfloat16).unsqueeze(1)
    w = (torch.randn(experts, n, k, generator=gen) * k ** -0.5).to("cuda", torch.bfloat16)
    dy = torch.zeros(r.rows, n, device="cuda", dtype=torch.bfloat16)
    dy[r.dest] = torch.randn(tokens * top_k, n, generator=gen).to("cuda", torch.bfloat16)
    cfg = Float8BlockConfig()
    xp = permute(x, r)
    qx = quantize_buffers(xp, cfg.activation, True, True)
    qdy = quantize_buffers(dy, cfg.grad, True, True)
    f8 = torch.float8_e4m3fn
    wd, ws = expert_weight_buffers(w, cfg.weight, False, True)
    wtd, wts = expert_weight_buffers(w, cfg.weight, False, False)
    return dict(routing=r, x=xp, w=w, dy=dy,
                fwd=(qx[0].view(f8), qx[1], wd, ws, r, torch.bfloat16),
                dgrad=(qdy[0].view(f8), qdy[1], wtd, wts, r, torch.bfloat16),
                wgrad=(qdy[2].view(f8), qdy[3], qx[2].view(f8), qx[3], r, torch.bfloat16))


def check(experts, top_k, tokens, k, n, kind):
    import torch

    from fp8blk.torch.moe.gemms import grouped_mm_rows, grouped_mm_weights
    ops = operands(experts, top_k, tokens, k, n, kind, seed=1)
    out = dict(kind=kind, experts=experts, tokens=tokens, k=k, n=n)
    for gemm, fn in (("fwd", grouped_mm_rows), ("dgrad", grouped_mm_rows),
                     ("wgrad", grouped_mm_weights)):
        got, want = _kernel(fn, *ops[gemm]), _loop(fn, *ops[gemm])
        g, f = got.float(), want.float()
        tol = torch.maximum(g.abs(), f.abs()) * 2.0 ** -7 + f.abs().max() * 2.0 ** -14
        out[gemm] = dict(equal_fraction=round(float((got == want).float().mean()), 6),
                         within_bound=bool(((g - f).abs() <= tol).all()))
    return out


def timing(name, experts, top_k, tokens, k, n, kind):
    from bench.bench_linear import interleaved_ms
    from bench.bench_moe import bf16_grouped_mm, sorted_rows
    from fp8blk.torch.moe.gemms import grouped_mm_rows, grouped_mm_weights
    ops = operands(experts, top_k, tokens, k, n, kind)
    r = ops["routing"]
    r.host()
    xs, offs = sorted_rows(ops["x"], r)
    dys, _ = sorted_rows(ops["dy"], r)
    gmm = bf16_grouped_mm()
    w = ops["w"]
    fns = {"bf16_fwd": lambda: gmm(xs, w.transpose(-2, -1), offs=offs),
           "bf16_dgrad": lambda: gmm(dys, w, offs=offs),
           "bf16_wgrad": lambda: gmm(dys.t(), xs, offs=offs)}
    for gemm, fn in (("fwd", grouped_mm_rows), ("dgrad", grouped_mm_rows),
                     ("wgrad", grouped_mm_weights)):
        fns[f"kernel_{gemm}"] = lambda fn=fn, a=ops[gemm]: _kernel(fn, *a)
        fns[f"loop_{gemm}"] = lambda fn=fn, a=ops[gemm]: _loop(fn, *a)
    ms = interleaved_ms(fns, inner=5, repeats=5, warmup=2)
    flop = 2.0 * tokens * top_k * k * n
    return dict(shape=name, routing=kind, **{f"{v}_tflops": round(flop / t / 1e9, 1)
                                              for v, t in ms.items()},
                **{f"kernel_{g}_vs_bf16": round(ms[f"bf16_{g}"] / ms[f"kernel_{g}"], 3)
                   for g in ("fwd", "dgrad", "wgrad")})


def main():
    import torch

    from bench.bench_moe import SHAPES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--checks-only", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--routings", default="balanced,skewed")
    args = ap.parse_args()
    res = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "command": "python3 " + " ".join(sys.argv),
           "checks": [], "timing": []}
    for case in [(8, 2, 1000, 512, 768, "balanced"), (8, 2, 1000, 512, 768, "skewed"),
                 (16, 4, 9, 256, 384, "balanced"), (6, 3, 700, 640, 256, "skewed"),
                 (128, 8, 4096, 2048, 1536, "skewed")]:
        out = check(*case)
        res["checks"].append(out)
        print("check", out, flush=True)
    if not args.checks_only:
        for name in args.shapes.split(","):
            for kind in args.routings.split(","):
                out = timing(name, *SHAPES[name], kind)
                res["timing"].append(out)
                print(out, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
