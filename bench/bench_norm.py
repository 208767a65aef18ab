"""RMSNorm forward and forward+backward on the GPU: HF's formula in torch ops (what
transformers runs), the same under torch.compile (inductor's fused kernels), and
Float8BlockRMSNorm on torch ops and on fp8blk's one-pass kernels; GPU time per call with CUDA
events (behind a sleeping GPU: no host time), including autograd's gradient accumulation into
x.grad and weight.grad; and each one-pass kernel alone, with the bytes it must move and its
bandwidth against a device copy.

    python3 -m bench.bench_norm [--out DIR]    # DIR/norm-<machine>.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

from bench import machine
from fp8blk.torch import norm
from fp8blk.torch.norm import Float8BlockRMSNorm, hf_rms_norm

# (rows, width): Llama-3-8B's hidden norms at 8192 tokens; Qwen3's per-head q / k norms there
SHAPES = [(8192, 4096), (8192 * 32, 128), (8192 * 8, 128)]


def gpu_ms(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        # the GPU sleeps while the host queues the sample: GPU time, not host time
        torch.cuda._sleep(40_000_000)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return min(times)


def copy_gbps(nbytes):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = gpu_ms(lambda: b.copy_(a))
    return 2 * nbytes / ms / 1e6


class HFRMSNorm(torch.nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.weight, self.variance_epsilon = w, eps

    def forward(self, x):
        return hf_rms_norm(x, self.weight, self.variance_epsilon)


def cases(m, d, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    dy = torch.randn(m, d, device="cuda", dtype=dtype, generator=gen)
    w = torch.nn.Parameter(torch.ones(d, device="cuda", dtype=dtype))
    hf = HFRMSNorm(w, 1e-6)
    fast = Float8BlockRMSNorm.from_norm(hf)
    assert fast is not None
    compiled = torch.compile(hf)

    def fwd(mod):
        def run():
            with torch.no_grad():
                mod(x)
        return run

    def fwd_train(mod):
        return lambda: mod(x)

    def step(mod):
        return lambda: mod(x).backward(dy)

    def with_kernels(on, fn):
        def run():
            norm.KERNELS = on
            try:
                fn()
            finally:
                norm.KERNELS = True
        return run

    out = {}
    for name, mod, on in [("hf_torch_ops", hf, True), ("hf_compiled", compiled, True),
                          ("fp8blk_torch_ops", fast, False), ("fp8blk_kernels", fast, True)]:
        out[name] = {"forward_ms": gpu_ms(with_kernels(on, fwd_train(mod))),
                     "fwd_bwd_ms": gpu_ms(with_kernels(on, step(mod)))}
        x.grad = None
        w.grad = None
    # the kernels alone (no autograd, no gradient accumulation)
    from fp8blk.kernels import rms_norm
    xd, w2 = x.detach(), w.detach()
    _, r = rms_norm.forward(xd, w2, 1e-6)
    out["kernel_alone_ms"] = {"forward": gpu_ms(lambda: rms_norm.forward(xd, w2, 1e-6)),
                              "backward": gpu_ms(lambda: rms_norm.backward(xd, w2, dy, r))}
    item = x.element_size()
    # the one-pass kernels' traffic: forward reads x, writes y (+ r); backward reads x, dy,
    # writes dx (+ r, partial sums)
    out["kernel_bytes"] = {"forward": 2 * m * d * item, "backward": 3 * m * d * item}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for norm-<machine>.json")
    args = ap.parse_args()
    copy = copy_gbps(256 << 20)
    gpu = torch.cuda.get_device_name()
    results = {"machine": {"gpu": gpu, "host": platform.node(), "torch": torch.__version__},
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(sys.argv), "copy_gbps": copy, "cases": []}
    for m, d in SHAPES:
        c = cases(m, d)
        k = c["kernel_alone_ms"]
        fwd_gbps = c["kernel_bytes"]["forward"] / k["forward"] / 1e6
        bwd_gbps = c["kernel_bytes"]["backward"] / k["backward"] / 1e6
        c.update({"rows": m, "width": d, "dtype": "bfloat16",
                  "kernel_forward_pct_copy": 100 * fwd_gbps / copy,
                  "kernel_backward_pct_copy": 100 * bwd_gbps / copy})
        results["cases"].append(c)
        line = ", ".join(f"{n} {v['forward_ms']:.3f}/{v['fwd_bwd_ms']:.3f}" for n, v in c.items()
                         if isinstance(v, dict) and "forward_ms" in v)
        print(f"({m}, {d}) fwd/fwd+bwd ms: {line}; kernels at {c['kernel_forward_pct_copy']:.0f}"
              f"% / {c['kernel_backward_pct_copy']:.0f}% of copy ({copy:.0f} GB/s)", flush=True)
    if args.out:
        with open(os.path.join(args.out, f"norm-{machine(gpu)}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
