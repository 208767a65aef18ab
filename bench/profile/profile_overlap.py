"""Can a quantize kernel run beside a blockwise FP8 GEMM? Times, at a Linear shape, the
weight-gradient GEMM alone, the weight's columnwise quantize alone, and both issued together
on two streams (if the pair takes about the sum, cuBLAS's GEMM holds every SM and nothing is
gained by overlapping).

Last result (H200, 2026-12-01): GEMM + quantize alone -> together 2384 + 53.5 -> 2459.6 us at
(16384, 8192, 8192), 2089 + 47.5 -> 2140.5 us at (16384, 4096, 14336): the sum.

    python3 -m bench.profile.profile_overlap [--shape 16384 8192 8192]
"""
from __future__ import annotations

import argparse

import torch

import fp8blk as fb
from bench.bench_linear import gpu_ms
from fp8blk.torch import blockwise_scaled_mm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[16384, 8192, 8192])
    m, k, n = ap.parse_args().shape
    dev = torch.device("cuda")
    f8 = torch.float8_e4m3fn
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    b1, b2 = fb.Block1D(), fb.Block2D()
    qx = fb.quantize(x, b1, True, True)
    qdy = fb.quantize(dy, b1, True, True)

    def wgrad():
        return blockwise_scaled_mm(qdy.columnwise_data.view(f8), qdy.columnwise_scale_inv,
                                   qx.columnwise_data.view(f8), qx.columnwise_scale_inv,
                                   "1x128", "1x128", torch.bfloat16)

    def wquant():
        return fb.quantize(w, b2, False, True)

    def xquant():
        return fb.quantize(x, b1, True, True)

    def wrow():
        return fb.quantize(w, b2, True, False)

    side = torch.cuda.Stream()
    main_s = torch.cuda.current_stream()

    def pair(a, b):
        def run():
            side.wait_stream(main_s)
            with torch.cuda.stream(side):
                b()
            a()
            main_s.wait_stream(side)
        return run

    cases = {"wgrad GEMM": wgrad, "W columnwise quantize": wquant,
             "wgrad GEMM + W columnwise quantize, one stream": lambda: (wgrad(), wquant()),
             "wgrad GEMM | W columnwise quantize on a side stream": pair(wgrad, wquant),
             "x row+col quantize": xquant, "W rowwise quantize": wrow,
             "x row+col | W rowwise on a side stream": pair(xquant, wrow)}
    print(f"shape (M, K, N) = ({m}, {k}, {n})")
    for name, fn in cases.items():
        print(f"{name:56s} {gpu_ms(fn, inner=20, repeats=5) * 1e3:9.1f} us", flush=True)


if __name__ == "__main__":
    main()
