"""Back-to-back Linear steps: host gaps or clocks?

bench_linear.py times each fwd+bwd two ways: back to back (the host in the loop) and with the
GPU queue filled first (a sleep kernel queued before each sample: the GPU work alone). The two
differ by up to ~12% at the large shapes, where the host (~0.7 ms per step) is far ahead of the
GPU (~6 ms). This tells the two possible causes apart, per shape and implementation:

* gaps: a torch.profiler trace of back-to-back steps, the kernels' summed time against the span
  from the first kernel's start to the last one's end (span - busy = the GPU idle inside it);
* clocks: ~1.5 s of sustained back-to-back steps, ~1.5 s of sleep-prefilled samples and ~1.5 s
  of the step captured in a CUDA graph and replayed back to back (sustained, no host in the
  loop), with the SM clock and power read by ``nvidia-smi`` every 100 ms in the background.

    python3 -m bench.profile.linear_gaps_clocks [--shapes 16384x8192x8192,8192x4096x4096]
"""
import argparse
import datetime
import os
import statistics
import subprocess
import tempfile
import time

import torch

from bench.bench_linear import fwd_bwd, graphed, host_us, sample_ms

from fp8blk.torch import Float8BlockLinear


def sustained(step, seconds):
    """ms per step of back-to-back steps for about `seconds`, and the wall window."""
    if seconds <= 0:
        return float("nan"), (0.0, 0.0)
    step()
    torch.cuda.synchronize()
    t0 = time.time()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(5):
            step()
        n += 5
        if n % 50 == 0:       # a bounded lead: the host is ~10x faster than the GPU here
            torch.cuda.current_stream().synchronize()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / n, (t0, time.time())


def prefilled(step, seconds, inner, fill):
    """ms per step of samples of `inner` steps each issued behind a `fill` ms GPU sleep."""
    t0 = time.time()
    times = []
    while time.time() - t0 < seconds:
        times.append(sample_ms(step, inner, fill))
    return (statistics.median(times) if times else float("nan")), (t0, time.time())


def trace(step, n, gaps=None):
    """(busy ms per step, span ms per step) of `n` back-to-back steps under torch.profiler.
    `gaps`: a dict filled with {(kernel before, kernel after): [idle us per step, count]}."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return float("nan"), float("nan")
    starts = [e.time_range.start for e in kernels]
    ends = [e.time_range.end for e in kernels]
    # union of the kernel intervals (us): busy time, whatever overlaps
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(zip(starts, ends)):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    if gaps is not None:
        order = sorted(kernels, key=lambda e: e.time_range.start)
        for a, b in zip(order, order[1:]):
            idle = b.time_range.start - a.time_range.end
            if idle > 5:
                hit = gaps.setdefault((a.name[:60], b.name[:60]), [0.0, 0])
                hit[0] += idle / n
                hit[1] += 1
    return busy / n / 1e3, (max(ends) - min(starts)) / n / 1e3


def smi_window(samples, window):
    inside = [(c, p) for t, c, p in samples if window[0] <= t <= window[1]]
    if not inside:
        return None, None
    return statistics.median(c for c, _ in inside), statistics.median(p for _, p in inside)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x8192x8192,8192x4096x4096")
    ap.add_argument("--seconds", type=float, default=1.5,
                    help="length of each sustained / prefilled phase (0: the traces only)")
    args = ap.parse_args()
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=log)
    rows = []
    dev = torch.device("cuda")
    try:
        for shape in args.shapes.split(","):
            m, k, n = map(int, shape.split("x"))
            bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            layers = {"bf16": bf16, "fp8blk": Float8BlockLinear.from_linear(bf16)}
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            for name, layer in layers.items():
                step = fwd_bwd(layer, x, g)
                host = host_us(step)
                gaps = {}
                busy, span = trace(step, 10, gaps)
                print(f"{shape} {name}: GPU idle > 5 us between kernels, us per step "
                      f"(count in 10 steps), largest first:")
                for (a, b), (us, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:6]:
                    print(f"   {us:7.1f} ({count:2d})  {a}  ->  {b}")
                ms_b2b, w_b2b = sustained(step, args.seconds)
                ms_pre, w_pre = prefilled(step, args.seconds, 10, 2 + 15 * host / 1000)
                ms_gr, w_gr = sustained(graphed(step), args.seconds)
                rows.append((shape, name, host, busy, span, ms_b2b, w_b2b, ms_pre, w_pre,
                             ms_gr, w_gr))
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    log.seek(0)
    samples = []
    for line in log.read().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(parts[1]), float(parts[2])))
    os.unlink(log.name)
    print(f"{len(samples)} nvidia-smi samples (SM MHz, W): medians over each phase's window")
    print(f"{'shape':18s} {'impl':7s} {'host us':>8s} {'trace busy':>10s} {'span':>7s} "
          f"{'b2b ms':>7s} {'MHz':>5s} {'W':>5s} {'prefill ms':>10s} {'MHz':>5s} {'W':>5s} "
          f"{'graph ms':>8s} {'MHz':>5s} {'W':>5s}")
    for shape, name, host, busy, span, ms_b2b, w_b2b, ms_pre, w_pre, ms_gr, w_gr in rows:
        c1, p1 = smi_window(samples, w_b2b)
        c2, p2 = smi_window(samples, w_pre)
        c3, p3 = smi_window(samples, w_gr)
        print(f"{shape:18s} {name:7s} {host:8.0f} {busy:10.3f} {span:7.3f} {ms_b2b:7.3f} "
              f"{c1 or 0:5.0f} {p1 or 0:5.0f} {ms_pre:10.3f} {c2 or 0:5.0f} {p2 or 0:5.0f} "
              f"{ms_gr:8.3f} {c3 or 0:5.0f} {p3 or 0:5.0f}")


if __name__ == "__main__":
    main()
