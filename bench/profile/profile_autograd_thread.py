"""Why Python costs more on autograd's device thread (the small Linear shape).

A Float8BlockLinear step's host time at (8192, 4096, 4096) is 815 us with autograd's
multithreading on (the default: the backward half runs on autograd's device thread, another
CPU core) and 294 us with it off, and every piece of the backward half runs ~2.5x slower. This probe tells a
cost that follows the handoff (a core waking up: its caches or clock cold for a while) from one
that lasts (a slow core, contention): a custom autograd function times the same pieces in its
forward (the calling thread) and in its backward (the device thread, or the calling thread
with multithreading off), once right after the handoff and once after ~300 us of busy Python.

Pieces: a pure-Python loop (1000 additions), 20 ``torch.empty_strided`` of a small CUDA tensor,
10 small ``torch.mm`` launches. Also the handoff latencies (backward() called -> the backward
function starts; it returns -> backward() returns) and the CPU each side ran on.

    python3 -m bench.profile.profile_autograd_thread [--steps 200]
"""
import argparse
import ctypes
import os
import statistics
import time

import torch

_libc = ctypes.CDLL(None)
_clock = time.perf_counter


def py_loop():
    s = 0
    for i in range(1000):
        s += i
    return s


def pieces(a, b):
    """Host us of each piece, in the thread that calls it."""
    out = {}
    t0 = _clock()
    py_loop()
    out["python loop (1000 adds)"] = (_clock() - t0) * 1e6
    t0 = _clock()
    for _ in range(20):
        torch.empty_strided((256, 256), (256, 1), dtype=torch.bfloat16, device=a.device)
    out["torch.empty_strided x20"] = (_clock() - t0) * 1e6
    t0 = _clock()
    for _ in range(10):
        torch.mm(a, b)
    out["torch.mm launch x10"] = (_clock() - t0) * 1e6
    return out


def spin(us):
    end = _clock() + us * 1e-6
    while _clock() < end:
        pass


rec = {}


class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b):
        rec["fwd cpu"] = _libc.sched_getcpu()
        rec["fwd"] = pieces(a, b)
        spin(300)
        rec["fwd warm"] = pieces(a, b)
        ctx.ab = (a, b)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        rec["t_bwd_start"] = _clock()
        rec["bwd cpu"] = _libc.sched_getcpu()
        a, b = ctx.ab
        rec["bwd"] = pieces(a, b)
        spin(300)
        rec["bwd warm"] = pieces(a, b)
        rec["t_bwd_end"] = _clock()
        return g, None, None


def run(steps, multithreading):
    torch.autograd.set_multithreading_enabled(multithreading)
    dev = torch.device("cuda")
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    b = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1024, device=dev, requires_grad=True)
    g = torch.ones(1024, device=dev)
    acc = {}
    cpus = set()
    for i in range(steps):
        y = Probe.apply(x, a, b)
        torch.cuda.synchronize()
        t0 = _clock()
        y.backward(g)
        t1 = _clock()
        torch.cuda.synchronize()
        x.grad = None
        if i < 5:
            continue
        cpus.add((rec["fwd cpu"], rec["bwd cpu"]))
        for where in ("fwd", "fwd warm", "bwd", "bwd warm"):
            for name, us in rec[where].items():
                acc.setdefault((where, name), []).append(us)
        acc.setdefault(("handoff", "backward() -> backward fn starts"), []).append(
            (rec["t_bwd_start"] - t0) * 1e6)
        acc.setdefault(("handoff", "backward fn ends -> backward() returns"), []).append(
            (t1 - rec["t_bwd_end"]) * 1e6)
    torch.autograd.set_multithreading_enabled(True)
    print(f"== autograd multithreading={multithreading}: median host us over {steps - 5} "
          f"steps; (forward CPU, backward CPU) pairs seen: {sorted(cpus)[:8]}"
          f"{' ...' if len(cpus) > 8 else ''} ({len(cpus)} distinct)", flush=True)
    for (where, name), v in acc.items():
        print(f"   {where:9s} {name:40s} {statistics.median(v):8.1f}  "
              f"(p10 {sorted(v)[len(v) // 10]:.1f}, p90 {sorted(v)[9 * len(v) // 10]:.1f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"affinity {sorted(os.sched_getaffinity(0))}, cpu_count {os.cpu_count()}")
    for mt in (True, False):
        run(args.steps, mt)


if __name__ == "__main__":
    main()
