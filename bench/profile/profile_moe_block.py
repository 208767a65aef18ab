"""Where an MoE block's forward+backward spends its GPU time: bf16 with transformers'
``grouped_mm`` experts beside the block converted by ``fp8blk.torch.moe.convert_experts``,
eager (and compiled with ``--compiled``), the kernels of a few profiled steps summed by name.

    python3 -m bench.profile.profile_moe_block [--block qwen3_30b] [--steps 3] [--top 30]

The blocks are ``bench.bench_moe``'s (router included, 8192 tokens). Writes the tables to
``--out`` (``bench/profile/results/profile-moe-block-h200.txt``).
"""
from __future__ import annotations

import argparse
import gc
import re

import torch

from bench.bench_moe import build_block


def _short(name):
    name = re.sub(r"_ZN\d+cudapy\d*", "", name)
    return name[:100]


def table(step, steps, top):
    """The kernels of `steps` profiled calls of `step`, summed by name: (lines, total ms per
    step)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    sums = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            k = _short(ev.name)
            n, s = sums.get(k, (0, 0.0))
            sums[k] = (n + 1, s + t)
    total = sum(s for _, s in sums.values()) / steps / 1e3
    lines = [f"  {s / steps / 1e3:8.3f} ms {100 * s / steps / 1e3 / total:5.1f}%  "
             f"x{n // steps:<4d} {k}"
             for k, (n, s) in sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]]
    return lines, total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block", default="qwen3_30b")
    p.add_argument("--variants", default="bf16,fp8blk")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = [f"# {torch.cuda.get_device_name()} torch {torch.__version__} block {args.block}"]
    modes = ["eager"] + (["compiled"] if args.compiled else [])
    for variant in args.variants.split(","):
        for mode in modes:
            full, block, step = build_block(args.block, variant)
            fn = torch.compile(block) if mode == "compiled" else block

            def run(fn=fn, step=step):
                step(fn)

            lines, total = table(run, args.steps, args.top)
            report.append(f"\n## {variant} {mode}: {total:.3f} ms of kernels per step")
            report.extend(lines)
            print("\n".join(report[-len(lines) - 1:]), flush=True)
            full = block = fn = step = run = None
            gc.collect()
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
