"""Where the host time of a Float8BlockLinear forward+backward goes (issues 13 and 14: the
FSDP2 step is host-bound). Per shape: host us per fwd+bwd (back-to-back, median of 7 x 50),
a cProfile of 200 steps by own time, and torch.profiler's CPU self time per op.

    python3 bench/profile/profile_linear_host.py [--shapes 256x8192x8192,8192x8192x8192]
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

from fp8blk.torch import Float8BlockLinear


def step(layer, x, g):
    y = layer(x)
    y.backward(g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x8192x8192,8192x8192x8192")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        layers = {"bf16": bf16, "fp8blk": Float8BlockLinear.from_linear(bf16)}
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        for name, layer in layers.items():
            for _ in range(20):
                step(layer, x, g)
            torch.cuda.synchronize()
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(50):
                    step(layer, x, g)
                times.append((time.perf_counter() - t0) / 50 * 1e6)
                torch.cuda.synchronize()
            print(f"== {shape} {name}: host {statistics.median(times):.1f} us per fwd+bwd "
                  f"(min {min(times):.1f})", flush=True)
            if name == "bf16":
                continue
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                step(layer, x, g)
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(18)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    step(layer, x, g)
            torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
