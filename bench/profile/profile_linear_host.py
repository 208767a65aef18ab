"""Where the host time of a Float8BlockLinear forward+backward goes. Per shape:
host us per fwd+bwd of bf16 nn.Linear and of Float8BlockLinear on its per-signature plan (its
GEMMs on cuBLASLt directly, ``_cublaslt``, the default, and on ``torch._scaled_mm``) and on
its general path
(``_linear_plans.plan_for`` patched to None), each with autograd's multithreading on (the
default: the backward half runs on autograd's device thread) and off (it runs on the calling
thread); then the host us of each piece of a planned step (quantize launcher,
``torch._scaled_mm`` / cuBLASLt ``ScaledMM``, ``torch.empty_strided``) and a cProfile of the
planned step. Host time is measured while a sleep kernel queued first holds the GPU, so the
launch queue never fills (median of 9 x 10 steps).

    python3 -m bench.profile.profile_linear_host [--shapes 8192x4096x4096,256x8192x8192]
"""
import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time

import torch

from bench.bench_linear import host_us

from fp8blk.torch import Float8BlockLinear, _cublaslt
from fp8blk.torch.linear import plans as _linear_plans


def pieces(step):
    """Median host us of each piece of a planned step (the pieces timed by wrapping them)."""
    from fp8blk.kernels import quantize as kq
    acc = collections.defaultdict(list)
    saved = []

    def wrap(obj, name, label):
        f = getattr(obj, name)
        saved.append((obj, name, f))

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = f(*a, **kw)
            acc[label].append(time.perf_counter() - t0)
            return out
        setattr(obj, name, timed)

    wrap(torch, "_scaled_mm", "torch._scaled_mm")
    wrap(_cublaslt.ScaledMM, "__call__", "cuBLASLt ScaledMM (allocation + call)")
    wrap(kq._TorchCall, "__call__", "quantize launcher (allocations + launch)")
    _linear_plans.plans.clear()      # new plans take the wrapped torch.empty_strided
    wrap(torch, "empty_strided", "torch.empty_strided")
    try:
        host_us(step)
    finally:
        for obj, name, f in reversed(saved):
            setattr(obj, name, f)
        _linear_plans.plans.clear()
    steps = 3 + 9 * 10
    return {k: (statistics.median(v) * 1e6, len(v) / steps) for k, v in acc.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x4096x4096")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        fp8 = Float8BlockLinear.from_linear(bf16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

        def step_of(layer):
            def step():
                layer.weight.grad = None
                x.grad = None
                layer(x).backward(g)
            return step

        plan_for = _linear_plans.plan_for
        for mt in (True, False):
            torch.autograd.set_multithreading_enabled(mt)
            row = {"bf16": host_us(step_of(bf16))}
            default = _cublaslt.enabled
            for lt, label in ((True, "cuBLASLt"), (False, "torch._scaled_mm")):
                _cublaslt.enabled = lt          # new plans take it
                _linear_plans.plans.clear()
                row[f"fp8blk plan, {label}"] = host_us(step_of(fp8))
            _cublaslt.enabled = default
            if len(_cublaslt.refusals):
                print(f"   cuBLASLt refused: {_cublaslt.refusals}")
            _linear_plans.plans.clear()
            _linear_plans.plan_for = lambda *a: None
            try:
                row["fp8blk general path"] = host_us(step_of(fp8))
            finally:
                _linear_plans.plan_for = plan_for
            print(f"== {shape} autograd multithreading={mt}: host us per fwd+bwd "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        torch.autograd.set_multithreading_enabled(True)
        print(f"   {len(_linear_plans.plans)} plan(s); pieces of a planned step "
              "(median us, calls per step):")
        for name, (us, per) in pieces(step_of(fp8)).items():
            print(f"   {name:42s} {us:7.1f} us  x{per:.0f}")
        torch.autograd.set_multithreading_enabled(False)   # cProfile sees this thread only
        step = step_of(fp8)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            step()
        pr.disable()
        torch.cuda.synchronize()
        torch.autograd.set_multithreading_enabled(True)
        print("   cProfile of 50 planned steps (multithreading off):")
        pstats.Stats(pr).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
