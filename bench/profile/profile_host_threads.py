"""What autograd's device thread does to a Linear step's host time: the forward call and the
backward call of bf16 ``nn.Linear`` and ``Float8BlockLinear``, eager and under
``torch.compile``, timed apart (median per call, 40 steps issued behind a sleeping GPU, 5
times), with autograd's multithreading on and off, and again with the calling thread idle
for 2 ms before each step; for fp8blk, the host time inside the pieces of its step
(perf_counter around each: the plan's backward, the lean forward GEMM, the quantize call,
``ScaledMM.run``, ``LaunchSite.launch``), on the thread that ran them.

With multithreading on, the backward pass runs on autograd's device thread while the
calling thread waits; the next forward call then starts on a thread that has been idle. On a
machine whose cores slow down while idle, every call after an idle spell costs more, and a
step with more host calls loses more: the "idle 2 ms" rows measure that directly, with the
same code on one thread.

    python3 -m bench.profile.profile_host_threads [--shape 8192x4096x4096] [--out F.txt]

Reads fp8blk's internals (probes may). Writes ``results/profile-host-threads-h200.txt``
with ``--out``.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from bench.profile.profile_linear_host import layers, wrap_timed

_spent = {}     # (piece, on the calling thread) -> [us per call]


def _timed(owner, name, label):
    """Wrap ``owner.name`` so that each call's host time lands in :data:`_spent`, by the
    thread that ran it."""
    def record(seconds):
        key = (label, threading.current_thread() is threading.main_thread())
        _spent.setdefault(key, []).append(seconds * 1e6)
    wrap_timed(owner, name, record)


def _instrument():
    from fp8blk.kernels import _launch
    from fp8blk.kernels import quantize as kq
    from fp8blk.torch import _cublaslt
    from fp8blk.torch.linear import plans
    _timed(plans.LinearPlan, "backward", "plan backward (dY, W.T, two GEMMs)")
    _timed(plans._Lean, "forward_mm", "lean forward GEMM (W, one GEMM)")
    _timed(kq._TorchCall, "__call__", "quantize x, allocating (compiled op)")
    _timed(_cublaslt.ScaledMM, "run", "ScaledMM.run (one cuBLASLt GEMM)")
    _timed(_launch.LaunchSite, "launch", "LaunchSite.launch (one quantize)")


def run(layer, x, g, pause, steps=40, reps=5):
    """(forward us, backward us) medians, and the pieces' lines."""
    for _ in range(5):
        layer.weight.grad = x.grad = None
        layer(x).backward(g)
    torch.cuda.synchronize()
    fwd, bwd = [], []
    _spent.clear()
    for _ in range(reps):
        torch.cuda._sleep(400_000_000)
        for _ in range(steps):
            layer.weight.grad = x.grad = None
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            y.backward(g)
            t2 = time.perf_counter()
            fwd.append((t1 - t0) * 1e6)
            bwd.append((t2 - t1) * 1e6)
        torch.cuda.synchronize()
    pieces = [f"      {label:40s} {'calling' if main else 'device '} thread: "
              f"{len(v) / (steps * reps):.0f} per step, {statistics.median(v):6.1f} us"
              for (label, main), v in sorted(_spent.items())]
    return statistics.median(fwd), statistics.median(bwd), pieces


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8192x4096x4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    m, k, n = (int(v) for v in args.shape.split("x"))
    device = torch.device("cuda")
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    _instrument()
    cases = {("eager", name): layer for name, layer in layers(k, n, device).items()}
    cases.update({("compiled", name): torch.compile(layer)
                  for name, layer in layers(k, n, device).items()})
    lines = [f"shape {args.shape}; host us per call, median"]
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for pause in (0.0, 0.002):
            for (mode, name), layer in cases.items():
                f, b, pieces = run(layer, x, g, pause)
                lines.append(f"{mode:8s} {name:6s} multithreading={threads!s:5s} "
                             f"idle before step={pause * 1e3:.0f} ms: forward {f:6.1f}, "
                             f"backward {b:6.1f}, sum {f + b:6.1f}")
                if name == "fp8blk":
                    lines += pieces
                print("\n".join(lines[-1 - (len(pieces) if name == "fp8blk" else 0):]),
                      flush=True)
    torch.autograd.set_multithreading_enabled(True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
