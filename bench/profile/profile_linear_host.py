"""Where a Float8BlockLinear step's host time goes, beside bf16 nn.Linear's: the host us per
fwd+bwd (issued behind a sleeping GPU: ``bench.bench_linear.host_us``), with autograd's
multithreading on and off, then cProfile's top functions (own time) over the same loop.
``--compiled``: each layer under torch.compile (inductor) instead, cProfile's functions sorted
by own and by cumulative time (the compiled ops' Python inside the generated code).

    python3 -m bench.profile.profile_linear_host [--shape 8192x4096x4096] [--n 200] [--top 40]
        [--compiled]

Writes ``bench/profile/results/profile-linear-host-h200.txt`` (``--compiled``:
``profile-linear-host-compiled-h200.txt``) with ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time

import torch

from bench.bench_linear import fwd_bwd, host_us
from fp8blk.torch import Float8BlockConfig, Float8BlockLinear


def layers(k, n, device):
    torch.manual_seed(0)
    bf16 = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    fp8 = Float8BlockLinear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    fp8.weight.data.copy_(bf16.weight.data)
    return {"bf16": bf16, "fp8blk": fp8}


def profile(step, n, top, sort=("tottime",)):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(200_000_000)
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for key in sort:
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
    return out.getvalue()


class _Ident(torch.autograd.Function):
    """A Python autograd Function with one kernel in forward and none in backward: what a
    Python backward costs on its own, with autograd's device threads and without."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


@contextlib.contextmanager
def allocating_plans():
    """The Linear's plans on their allocating path (every buffer from torch's allocator, the
    launches and GEMMs through their allocating calls): the lean path's baseline."""
    from fp8blk.torch.linear import plans
    original = plans._Lean.stream
    plans._Lean.stream = lambda self: None
    try:
        yield
    finally:
        plans._Lean.stream = original


def thread_costs(x, g):
    """Host us per fwd+bwd of ``x * 1`` (a C++ backward) and of :class:`_Ident` (a Python
    one), autograd multithreading on and off."""
    out = []
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, fn in (("cpp_backward", lambda: x * 1), ("python_backward",
                                                           lambda: _Ident.apply(x))):
            def step(fn=fn):
                x.grad = None
                fn().backward(g)
            out.append(f"{name:15s} multithreading={threads!s:5s} host "
                       f"{host_us(step, n=10, repeats=15):7.1f} us per fwd+bwd")
            print(out[-1], flush=True)
    return out


def wrap_timed(owner, name, record):
    """Replace ``owner.name`` by a wrapper that calls ``record(seconds)`` with each call's
    host time (perf_counter around it); returns the original, to set back."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0)
    setattr(owner, name, call)
    return inner


def inside_plan(x, g, k, n, device):
    """Host us spent inside the plan's lean forward / backward per step (perf_counter around
    ``plans._Lean.forward`` / ``.backward``), multithreading on and off: the backward's own
    time on autograd's device thread against the calling thread."""
    from fp8blk.torch.linear import plans
    spent = {"forward": 0.0, "backward": 0.0}

    def adder(name):
        def add(seconds):
            spent[name] += seconds
        return add

    out = []
    originals = {name: wrap_timed(plans._Lean, name, adder(name)) for name in spent}
    try:
        for threads in (True, False):
            torch.autograd.set_multithreading_enabled(threads)
            step = fwd_bwd(layers(k, n, device)["fp8blk"], x, g)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            for key in spent:
                spent[key] = 0.0
            reps = 100
            torch.cuda._sleep(200_000_000)
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            total = (time.perf_counter() - t0) / reps * 1e6
            torch.cuda.synchronize()
            out.append(f"fp8blk multithreading={threads!s:5s} step {total:7.1f} us: inside "
                       f"lean forward {spent['forward'] / reps * 1e6:6.1f}, lean backward "
                       f"{spent['backward'] / reps * 1e6:6.1f}")
            print(out[-1], flush=True)
    finally:
        for name, fn in originals.items():
            setattr(plans._Lean, name, fn)
    return out


def floor_costs(m, k, n, device):
    """Host us per call of what a lean step is made of, each alone behind a sleeping GPU: one
    cuBLASLt block-scaled GEMM on fixed addresses (ScaledMM.run; a step has 3), one quantize
    launch on fixed addresses (a step has 4), one torch.empty_strided (a step has 5), and
    bf16's own GEMM call, torch.mm with its output allocation (nn.Linear's step has 3)."""
    from fp8blk.torch import _arena
    from fp8blk.torch.linear import plans
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    plan = plans.plan_for(x, w, Float8BlockConfig(), torch.bfloat16, False, False)
    lean = plan.lean
    stream = lean.stream()
    base = _arena.reserve(lean.index, stream, lean.need_fwd, lean.device)
    xd, xs, wd, ws, work = (base + o for o in lean.fwd)
    y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    args = lean.qx.arguments(x.data_ptr(), [xd, xs, None, None])
    site = lean.sx
    site.args[0], site.args[1], site.args[2] = x.data_ptr(), xd, xs
    site.args[3] = site.args[4] = x.data_ptr()

    def site_launch():
        a = site.args
        a[0], a[1], a[2] = x.data_ptr(), xd, xs
        site.launch(stream)
    calls = {
        "cuBLASLt block-scaled GEMM (ScaledMM.run)": lambda: lean.mm_fwd.run(
            xd, wd, xs, ws, y.data_ptr(), work, stream),
        "quantize launch (argument list, raw_launch)": lambda: lean.qx.launch(args, stream),
        "quantize launch (LaunchSite, 3 slots set)": site_launch,
        "torch.empty_strided (M, N) bf16": lambda: torch.empty_strided(
            (m, n), (n, 1), dtype=torch.bfloat16, device=device),
        "bf16 torch.mm with its output": lambda: torch.mm(x, w.t()),
    }
    out = []
    for name, fn in calls.items():
        us = host_us(fn, n=100, repeats=9)
        out.append(f"per call: {name:45s} {us:6.1f} us")
        print(out[-1], flush=True)
    return out


def compiled_costs(x, g, k, n, device, args):
    """Host us per fwd+bwd of each layer under torch.compile, multithreading on and off, then
    cProfile by own and by cumulative time (multithreading off)."""
    compiled = {name: torch.compile(layer) for name, layer in layers(k, n, device).items()}
    lines = []
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, layer in compiled.items():
            us = host_us(fwd_bwd(layer, x, g), n=50, repeats=9)
            lines.append(f"{name:7s} compiled multithreading={threads!s:5s} host {us:7.1f} us "
                         f"per fwd+bwd")
            print(lines[-1], flush=True)
    torch.autograd.set_multithreading_enabled(False)
    for name, layer in compiled.items():
        text = profile(fwd_bwd(layer, x, g), args.n, args.top, ("tottime", "cumulative"))
        lines.append(f"\n==== {name} compiled: cProfile over {args.n} steps (multithreading "
                     f"off)\n{text}")
        print(lines[-1], flush=True)
    torch.autograd.set_multithreading_enabled(True)
    return lines


def eager_costs(x, g, m, k, n, device, args):
    lines = []
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, layer in layers(k, n, device).items():
            us = host_us(fwd_bwd(layer, x, g), n=50, repeats=9)
            lines.append(f"{name:7s} multithreading={threads!s:5s} host {us:7.1f} us per fwd+bwd")
            print(lines[-1], flush=True)
        with allocating_plans():
            us = host_us(fwd_bwd(layers(k, n, device)["fp8blk"], x, g), n=50, repeats=9)
        lines.append(f"fp8blk, the plan's allocating path (no scratch arena, as under CUDA-graph "
                     f"capture) multithreading={threads!s:5s} host {us:7.1f} us per fwd+bwd")
        print(lines[-1], flush=True)
    lines += thread_costs(torch.randn(m, k, device=device, dtype=torch.bfloat16,
                                      requires_grad=True),
                          torch.randn(m, k, device=device, dtype=torch.bfloat16))
    lines += inside_plan(x, g, k, n, device)
    lines += floor_costs(m, k, n, device)
    torch.autograd.set_multithreading_enabled(False)
    for name, layer in layers(k, n, device).items():
        text = profile(fwd_bwd(layer, x, g), args.n, args.top)
        lines.append(f"\n==== {name}: cProfile over {args.n} steps (multithreading off)\n{text}")
        print(lines[-1], flush=True)
    torch.autograd.set_multithreading_enabled(True)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8192x4096x4096")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compiled", action="store_true",
                        help="each layer under torch.compile (inductor)")
    args = parser.parse_args(argv)
    m, k, n = (int(v) for v in args.shape.split("x"))
    device = torch.device("cuda")
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    lines = compiled_costs(x, g, k, n, device, args) if args.compiled else eager_costs(
        x, g, m, k, n, device, args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
