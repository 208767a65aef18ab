"""Float8BlockLinear forward under torch.no_grad against the same forward in grad mode (which
also writes x's columnwise FP8 copy for the backward pass): GPU ms per forward (CUDA events
around back-to-back calls, median of 7 x 20) and the forward's peak memory above its start.

    python3 -m bench.profile.linear_no_grad [--shapes 16384x8192x8192,8192x4096x4096]
"""
import argparse

from bench.bench_linear import gpu_ms

import torch

from fp8blk.torch import Float8BlockLinear


def peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    y = fn()
    torch.cuda.synchronize()
    del y
    return torch.cuda.max_memory_allocated() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="16384x8192x8192,8192x4096x4096")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        layer = Float8BlockLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def train():
            return layer(x)

        def no_grad():
            with torch.no_grad():
                return layer(x)
        t = {name: gpu_ms(fn, inner=20) for name, fn in (("grad mode", train), ("no_grad", no_grad))}
        p = {name: peak(fn) for name, fn in (("grad mode", train), ("no_grad", no_grad))}
        print(f"({m}, {k}, {n}) forward ms: " + ", ".join(f"{a} {v:.3f}" for a, v in t.items())
              + " | peak MB above start: " + ", ".join(f"{a} {v / 2**20:.0f}"
                                                       for a, v in p.items()), flush=True)


if __name__ == "__main__":
    main()
