"""FSDP2 with FP8 weights: step time and bytes all-gathered per step (modes "primary" and "cast" of ``fp8blk.torch.fsdp``).

A 4-layer model of Float8BlockLinear layers (``--width`` wide, default 8192, no bias) under
FSDP2 (every layer and the root ``fully_shard``-ed, reshard_after_forward=True), three ways:

  bf16      bf16 parameters: FSDP gathers 2 bytes per element, the layer quantizes the weight
  primary   FP8 primary weights, fp32 master shards, cast_master_weights_ per step
  cast      bf16 parameters, FP8 on the wire, precompute_fp8_scales per step
  bf16_master  fp32 parameters, FSDP2 MixedPrecisionPolicy(param_dtype=bf16): gathers 2 bytes
            per element cast from the fp32 shards, the optimizer updates fp32 weights; what
            the primary mode replaces (``step_time_vs_bf16_master``)

Timed steps are interleaved across the cases (one step of each per round, the order rotated
per round), so that GPU clock drift falls on every case alike.

Per case: median step time (GPU, CUDA events around the whole step) and the host time to
issue it, bytes this rank sent through FSDP's all-gathers per step (counted at the
collective); then, over as many further steps (so that their events and perf_counter calls
stay out of the step times), the time inside fsdp_pre_all_gather / fsdp_post_all_gather
(host perf_counter and GPU events, per step) and the time of the per-step FP8 cast of all
weights. Before timing, one step of each FP8 mode checks after every all-gather that the
gathered bytes and scales equal ``fb.quantize(bf16(full weight))`` (full weight: the
gathered parameters, or the masters).

``--profile STEPS``: after that, a cProfile of STEPS more steps per case on rank 0 (CPU or
GPU), ~40 lines to stderr: Python calls per step, calls and own time by area (fp8blk.torch,
FSDP2, autograd, C builtins...), the top functions by own time and the FP8 weight path's
functions by cumulative time; ``--profile-dump DIR`` keeps DIR/<case>.pstats.
``--trace STEPS``: a torch.profiler trace of STEPS more steps per case on rank 0 (GPU): the
kernel time per step by area (GEMM, NCCL, fp8blk kernels, other torch kernels, copies) and
the top kernels, to stderr: where the GPU time goes.

Run (writes its run, with machine, date, command and the figures, as section ``tokens<T>`` of
the ``--out`` file: ``bench.write_section``; a run replaces its token count's section and
leaves the others, so bench/results/fsdp-h200x2.json holds 8192 and 2048 tokens per rank):

    torchrun --standalone --nproc-per-node=1 -m bench.bench_fsdp --out bench/results/
    torchrun --standalone --nproc-per-node=2 -m bench.bench_fsdp --out bench/results/
    # CPU smoke run (gloo): --device cpu --width 256 --tokens 256 --steps 2
    # where the host time goes, on two GPUs:
    torchrun --standalone --nproc-per-node=2 -m bench.bench_fsdp --profile 5 --out /tmp/

A folder as ``--out`` gets the standard name ``fsdp-<machine>.json`` (machine ``h200`` on
one GPU, ``h200x2`` on two).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8blk as fb
from bench import machine, write_section
from fp8blk.torch import Float8BlockConfig, convert_to_float8_block
from fp8blk.torch import fsdp as F
from fp8blk.torch.fsdp import weights as W


class Timer:
    """Host and GPU time of the FSDP hooks of FP8 weights (patched class methods)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.host = {"pre": 0.0, "post": 0.0}
        self.events = {"pre": [], "post": []}
        self.calls = {"pre": 0, "post": 0}
        self.orig = (W.PlaneWeight.fsdp_pre_all_gather, W.PlaneWeight.fsdp_post_all_gather)
        self.check = None  # callable(q, state) run after each post hook (not timed)

    def _wrap(self, name, fn):
        timer = self

        @functools.wraps(fn)  # FSDP2 inspects the hook's signature
        def call(*args, **kwargs):
            ev = None
            if timer.cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            t0 = time.perf_counter()
            res = fn(*args, **kwargs)
            timer.host[name] += time.perf_counter() - t0
            if ev is not None:
                ev[1].record()
                timer.events[name].append(ev)
            timer.calls[name] += 1
            if name == "post" and timer.check is not None:
                out = kwargs.get("out")
                box = out._box if out is not None else res[0]._box
                timer.check(box.q, args[2][0])
            return res
        return call

    def install(self):
        W.PlaneWeight.fsdp_pre_all_gather = self._wrap("pre", self.orig[0])
        W.PlaneWeight.fsdp_post_all_gather = self._wrap("post", self.orig[1])

    def uninstall(self):
        W.PlaneWeight.fsdp_pre_all_gather, W.PlaneWeight.fsdp_post_all_gather = self.orig

    def reset(self):
        for d in (self.host, self.calls):
            for k in d:
                d[k] = 0
        self.events = {"pre": [], "post": []}

    def gpu_ms(self, name):
        return sum(a.elapsed_time(b) for a, b in self.events[name])


class ByteCounter:
    """Bytes this rank sends through all-gathers (FSDP2's all_gather_single /
    all_gather_into_tensor): the output bytes divided by the world size."""

    def __init__(self, world):
        self.world = world
        self.sent = 0
        self.names = [n for n in ("all_gather_single", "all_gather_into_tensor")
                      if hasattr(dist, n)]
        self.orig = {n: getattr(dist, n) for n in self.names}
        for n in self.names:
            setattr(dist, n, self._wrap(n))

    def _wrap(self, name):
        def call(output_tensor, input_tensor, *a, **k):
            self.sent += output_tensor.numel() * output_tensor.element_size() // self.world
            return self.orig[name](output_tensor, input_tensor, *a, **k)
        return call


def build(case, args, device, mesh, gen):
    layers = [torch.nn.Linear(args.width, args.width, bias=False, device=device)
              for _ in range(args.layers)]
    with torch.no_grad():
        for lin in layers:
            w = torch.randn(lin.weight.shape, generator=gen, device="cpu")
            # rows spanning orders of magnitude: tiles get different scales
            w *= 10.0 ** (torch.rand(w.shape[0], 1, generator=gen) * 2 - 1)
            lin.weight.copy_((w / args.width ** 0.5).to(device))
    model = torch.nn.Sequential(*layers)
    # bf16 parameters in every case but bf16_master (primary: its nominal dtype, so gradients
    # are bf16 and the reduce-scatter moves what the bf16 baseline's does; the masters are
    # fp32); bf16_master: fp32 parameters that FSDP2 casts to bf16 for the all-gather, the
    # usual mixed-precision setup that the primary mode replaces (both keep fp32 weights to update)
    mp = None
    if case == "bf16_master":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    else:
        model = model.to(torch.bfloat16)
    convert_to_float8_block(model, Float8BlockConfig(), share_quantize=False)  # the layers alone
    if case in F.MODES:
        F.prepare_fsdp_fp8(model, mode=case, model_dtype=torch.bfloat16)
    kw = {} if mp is None else {"mp_policy": mp}
    for lin in model:
        fully_shard(lin, mesh=mesh, reshard_after_forward=True, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, **kw)
    if case == "primary":
        masters = F.master_weights(model)
        opt = torch.optim.SGD(masters, lr=1e-4)
    else:
        masters = None
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    return model, opt, masters


def states_of(model):
    return [m.weight._local_tensor._state for m in model
            if type(m.weight).__name__ == "DTensor"
            and isinstance(m.weight._local_tensor, W.PlaneWeight)]


def step(case, model, opt, masters, x, cast_times=None):
    """One training step. ``cast_times`` (a list) gets (host s, start event, end event) of
    the per-step FP8 cast: cast_master_weights_ (primary) or precompute_fp8_scales (cast)."""
    opt.zero_grad(set_to_none=True)
    y = model(x)
    y.float().square().mean().backward()
    if case == "primary":
        F.master_grads_(model, masters)
    opt.step()
    if case not in F.MODES:
        return
    ev = None
    if cast_times is not None and x.is_cuda:
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
    t0 = time.perf_counter()
    if case == "primary":
        F.cast_master_weights_(model, masters)
    else:
        F.precompute_fp8_scales(model)
    if cast_times is not None:
        host = time.perf_counter() - t0
        if ev is not None:
            ev[1].record()
        cast_times.append((host, ev))


def full_weights(case, model, masters, rows_cols):
    """The full high-precision weights on every rank (all-gathered): params or masters."""
    out = []
    ws = dist.get_world_size()
    linears = list(model)
    for i, (rows, cols) in enumerate(rows_cols):
        if case == "primary":
            local = masters[i].detach().reshape(-1)
        else:
            local = linears[i].weight._local_tensor.hp.reshape(-1)
        chunk = -(-rows // ws) * cols
        pad = torch.zeros(chunk, dtype=local.dtype, device=local.device)
        pad[: local.numel()] = local
        gathered = torch.empty(chunk * ws, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, pad)
        out.append(gathered[: rows * cols].reshape(rows, cols))
    return out


_FP8_PATH = ("fp8blk/torch/weight.py", "fp8blk/torch/fsdp.py", "fp8blk/torch/_fsdp_state.py")


def _area(filename):
    """Which code a profiled function belongs to (the summary's columns)."""
    f = filename.replace(os.sep, "/")
    for key, name in (("/fp8blk/torch/", "fp8blk.torch"), ("/fp8blk/", "fp8blk"),
                      ("/torch/distributed/fsdp/", "torch fsdp"),
                      ("/torch/distributed/", "torch.distributed"),
                      ("/torch/autograd/", "torch.autograd"), ("/torch/", "torch other")):
        if key in f:
            return name
    return "C builtins" if f == "~" else "other"


def profile_steps(case, args, rank, cuda, run_step):
    """cProfile of ``args.profile`` more steps on rank 0 (every rank steps: collectives):
    Python calls per step, calls and own time per step by area, the top functions by own
    time, and the FP8 weight path's (hooks, casts) by cumulative time, to stderr (about 40
    lines); with ``--profile-dump DIR`` also DIR/<case>.pstats. cProfile inflates the host
    time; the hooks are not timed meanwhile."""
    import cProfile
    import pstats

    steps = args.profile
    prof = cProfile.Profile()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if rank == 0:
        prof.enable()
    for _ in range(steps):
        run_step()
    if rank == 0:
        prof.disable()
    host = (time.perf_counter() - t0) * 1e3 / steps
    if cuda:
        torch.cuda.synchronize()
    if rank != 0:
        return
    stats = pstats.Stats(prof)
    if args.profile_dump:
        os.makedirs(args.profile_dump, exist_ok=True)
        stats.dump_stats(os.path.join(args.profile_dump, f"{case}.pstats"))
    rows = [(k, nc / steps, tt * 1e3 / steps, ct * 1e3 / steps)
            for k, (cc, nc, tt, ct, _) in stats.stats.items()]
    areas = {}
    for (f, _, _), n, tt, _ in rows:
        a = areas.setdefault(_area(f), [0.0, 0.0])
        a[0] += n
        a[1] += tt
    out = [f"==== {case}: {steps} profiled steps on rank 0, {stats.total_calls // steps} "
           f"Python calls per step, host {host:.2f} ms per step under cProfile",
           "  by area, calls / own ms per step: " + " | ".join(
               f"{a} {n:.0f} / {t:.2f}" for a, (n, t) in
               sorted(areas.items(), key=lambda kv: -kv[1][1]))]

    def name(k):
        f, line, fn = k
        f = f.replace(os.sep, "/")
        for cut in ("/site-packages/", "/fp8blk/"):
            if cut in f:
                f = ("fp8blk/" if cut == "/fp8blk/" else "") + f.split(cut, 1)[1]
        return fn if f == "~" else f"{f}:{line}({fn})"

    def table(title, picked):
        out.append(f"  {title}: calls/step  own ms  cum ms")
        out.extend(f"  {n:8.1f} {tt:8.3f} {ct:8.3f}  {name(k)}" for k, n, tt, ct in picked)

    table(f"top {args.profile_top} by own time",
          sorted(rows, key=lambda r: -r[2])[:args.profile_top])
    path = [r for r in rows if any(r[0][0].replace(os.sep, "/").endswith(f) for f in _FP8_PATH)]
    table("FP8 weight path (fp8blk/torch/weight.py, fsdp.py, _fsdp_state.py) by cumulative "
          "time", sorted(path, key=lambda r: -r[3])[:10])
    print("\n".join(out), file=sys.stderr, flush=True)


def _kernel_area(name):
    n = name.lower()
    for key, area in (("nccl", "NCCL"), ("kernel_", "fp8blk kernels"), ("gemm", "GEMM"),
                      ("sm90", "GEMM"), ("cutlass", "GEMM"), ("memcpy", "copies"),
                      ("memset", "copies")):
        if key in n:
            return area
    return "torch other"


def trace_steps(case, args, rank, run_step):
    """torch.profiler over ``args.trace`` more steps on rank 0 (every rank steps): the GPU
    kernel time per step by area (GEMM, NCCL, fp8blk kernels, torch other, copies) and the
    top kernels, to stderr, against the step's wall time: where the GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    steps = args.trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=False) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    if rank != 0:
        return
    kernels, areas = {}, {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        k = kernels.setdefault(ev.name, [0, 0.0])
        k[0] += 1
        k[1] += us
        a = _kernel_area(ev.name)
        areas[a] = areas.get(a, 0.0) + us
    total = sum(areas.values())
    out = [f"==== {case}: {steps} traced steps on rank 0: {wall:.2f} ms wall per step, GPU "
           f"kernels {total / 1e3 / steps:.2f} ms per step (overlapping streams add up)",
           "  by area, ms per step: " + " | ".join(
               f"{a} {t / 1e3 / steps:.3f}" for a, t in sorted(areas.items(),
                                                               key=lambda kv: -kv[1]))]
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.trace_top]:
        out.append(f"  {n / steps:6.1f} x {us / n:9.1f} us = {us / 1e3 / steps:7.3f} ms  "
                   f"{name[:110]}")
    print("\n".join(out), file=sys.stderr, flush=True)


class Case:
    """One configuration's model, optimizer, input and results, alive for the whole run so
    that the timed steps of all cases can be interleaved."""

    def __init__(self, case, args, device, mesh, world):
        gen = torch.Generator().manual_seed(1234)
        self.name = case
        self.model, self.opt, self.masters = build(case, args, device, mesh, gen)
        self.x = torch.randn(args.tokens, args.width, generator=gen).to(
            device=device, dtype=torch.bfloat16)
        self.cuda = device.type == "cuda"
        self.result = {"case": case, "world": world, "width": args.width,
                       "layers": args.layers, "tokens": args.tokens}
        self.gpu, self.host, self.sent, self.hook_bytes = [], [], [], []

    def step(self, cast_times=None):
        step(self.name, self.model, self.opt, self.masters, self.x, cast_times)


def prepare(c, args):
    """Warm-up steps, and for the FP8 modes one step checking after every all-gather that the
    gathered bytes and scales equal fb.quantize(bf16(full weight))."""
    case, model, opt, masters = c.name, c.model, c.opt, c.masters
    timer = Timer(c.cuda)
    timer.install()
    try:
        c.step()  # warm-up (and the primary mode's first cast)
        if case in F.MODES:
            shapes = [(args.width, args.width)] * args.layers
            full = full_weights(case, model, masters, shapes)
            states = [lin.weight._local_tensor._state for lin in model]
            want = {id(s): fb.quantize(w.to(torch.bfloat16).contiguous(), s.recipe,
                                       rowwise=True, columnwise=True)
                    for s, w in zip(states, full)}
            del full
            checked = [0]

            def check(q, state):
                e = want[id(state)]
                pairs = []
                if q.has_rowwise:
                    pairs += [(q.rowwise_data, e.rowwise_data),
                              (q.rowwise_scale_inv, e.rowwise_scale_inv)]
                if q.has_columnwise:
                    pairs += [(q.columnwise_data, e.columnwise_data),
                              (q.columnwise_scale_inv, e.columnwise_scale_inv)]
                for got, exp in pairs:
                    if not torch.equal(got, exp):
                        raise AssertionError(f"{case}: gathered FP8 weight differs from "
                                             f"quantize(bf16(full weight))")
                checked[0] += 1

            timer.check = check
            # the check step must not change the weights (lr 0): the expected bytes hold
            lrs = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = 0.0
            c.step()
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
            timer.check = None
            del want
            c.result["byte_checks_passed"] = checked[0]
        for _ in range(args.warmup):
            c.step()
    finally:
        timer.uninstall()


def timed_steps(cases, args, counter):
    """``args.steps`` rounds; each round times one step of every case, in an order rotated by
    one per round: GPU clocks drift by several percent over a run (FP8 GEMMs are power
    bound), and interleaving gives every case the same drift. Nothing times the hooks or the
    cast inside these steps (their events and perf_counter calls would add host time the
    bf16 case does not pay)."""
    for c in cases:
        for s in states_of(c.model):
            s.gathers.clear()
    if cases[0].cuda:
        torch.cuda.synchronize()
    for r in range(args.steps):
        for c in cases[r % len(cases):] + cases[:r % len(cases)]:
            counter.sent = 0
            if c.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            c.step()
            c.host.append((time.perf_counter() - t0) * 1e3)
            if c.cuda:
                end.record()
                torch.cuda.synchronize()
                c.gpu.append(start.elapsed_time(end))
            c.sent.append(counter.sent)
            if c.name in F.MODES:
                c.hook_bytes.append(sum(g["bytes"] for s in states_of(c.model)
                                        for g in s.gathers))
                for s in states_of(c.model):
                    s.gathers.clear()


def breakdown(c, args, rank):
    """As many steps again with the hooks and the per-step cast timed (host and GPU), then
    the optional trace and profile; fills ``c.result``."""
    timer = Timer(c.cuda)
    pre_h, post_h, pre_g, post_g, cast_h, cast_g = [], [], [], [], [], []
    timer.install()
    try:
        for _ in range(args.steps):
            timer.reset()
            casts = []
            c.step(casts)
            if c.cuda:
                torch.cuda.synchronize()
                pre_g.append(timer.gpu_ms("pre"))
                post_g.append(timer.gpu_ms("post"))
            for h, ev in casts:
                cast_h.append(h * 1e3)
                if ev is not None:
                    cast_g.append(ev[0].elapsed_time(ev[1]))
            pre_h.append(timer.host["pre"] * 1e3)
            post_h.append(timer.host["post"] * 1e3)
    finally:
        timer.uninstall()
    run = functools.partial(step, c.name, c.model, c.opt, c.masters, c.x)
    if args.trace and c.cuda:
        trace_steps(c.name, args, rank, run)
    if args.profile:  # every rank steps (collectives), rank 0 profiles
        profile_steps(c.name, args, rank, c.cuda, run)
    med = statistics.median
    c.result.update({
        "step_gpu_ms": med(c.gpu) if c.gpu else None,
        "step_gpu_ms_all": [round(t, 3) for t in c.gpu],
        "step_host_ms": med(c.host),
        "bytes_sent_per_step": med(c.sent),
        # bytes the pre-all-gather hooks hand FSDP per step (this rank's FP8 inputs)
        "hook_bytes_per_step": med(c.hook_bytes) if c.hook_bytes else None,
        "hook_calls_per_step": dict(timer.calls),
        "pre_all_gather_host_ms": med(pre_h), "post_all_gather_host_ms": med(post_h),
        "pre_all_gather_gpu_ms": med(pre_g) if pre_g else None,
        "post_all_gather_gpu_ms": med(post_g) if post_g else None,
        # the per-step FP8 cast of all weights (primary: cast_master_weights_, cast:
        # precompute_fp8_scales): one packed all-reduce plus the batched kernels
        "fp8_cast_host_ms": med(cast_h) if cast_h else None,
        "fp8_cast_gpu_ms": med(cast_g) if cast_g else None,
    })


def run_cases(names, args, device, mesh, rank, world):
    counter = ByteCounter(world)
    try:
        cases = [Case(n, args, device, mesh, world) for n in names]
        for c in cases:
            prepare(c, args)
        timed_steps(cases, args, counter)
        for c in cases:
            breakdown(c, args, rank)
    finally:
        for n in counter.names:
            setattr(dist, n, counter.orig[n])
    peak = (torch.cuda.max_memory_allocated() / 2 ** 30) if device.type == "cuda" else None
    for c in cases:
        c.result["peak_memory_gib_all_cases"] = peak
    return [c.result for c in cases]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cases", default="bf16,primary,cast,bf16_master")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after timing, cProfile STEPS more steps of each case on rank 0 (stderr)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--trace", type=int, default=0, metavar="STEPS",
                   help="after timing, torch.profiler over STEPS more steps of each case on "
                        "rank 0: GPU kernel time per step by area and the top kernels (stderr)")
    p.add_argument("--trace-top", type=int, default=18)
    p.add_argument("--profile-dump", default=None, metavar="DIR",
                   help="with --profile: also write DIR/<case>.pstats (rank 0)")
    p.add_argument("--out", default=None, help="JSON output path, or a folder to write "
                   "fsdp-<machine>.json in; the run is its section tokens<T> (rank 0 writes "
                   "it)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda:  # before the process group, so NCCL binds each rank to its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    results = run_cases(args.cases.split(","), args, device, mesh, rank, world)
    # The cases' FSDP2 modules hold reference cycles (hooks <-> modules) and, through the
    # mesh, the process group: free them now, not during interpreter finalization after
    # destroy_process_group (a CI run once ended with "terminate called without an active
    # exception", SIGABRT on rank 0, after the report was printed)
    del mesh
    gc.collect()
    base = next((r for r in results if r["case"] == "bf16"), None)
    if base is not None:
        for r in results:
            # (one rank: FSDP2 calls the hooks but moves nothing through a collective)
            r["bytes_vs_bf16"] = (r["bytes_sent_per_step"] / base["bytes_sent_per_step"]
                                  if base["bytes_sent_per_step"] else None)
            if r["step_gpu_ms"] and base["step_gpu_ms"]:
                r["step_time_vs_bf16"] = r["step_gpu_ms"] / base["step_gpu_ms"]
    mp_base = next((r for r in results if r["case"] == "bf16_master"), None)
    if mp_base is not None and mp_base["step_gpu_ms"]:
        for r in results:
            if r["step_gpu_ms"]:
                r["step_time_vs_bf16_master"] = r["step_gpu_ms"] / mp_base["step_gpu_ms"]
    if rank == 0:
        report = {
            "machine": {"host": platform.node(), "python": platform.python_version(),
                        "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name() if cuda else None,
                        "world": world},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([sys.executable] + sys.argv),
            "cases": results,
        }
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            path = args.out
            if os.path.isdir(path) or path.endswith(os.sep):  # a folder: the standard name
                gpu = report["machine"]["gpu"] or "cpu"
                path = os.path.join(path, f"fsdp-{machine(gpu, world)}.json")
            write_section(path, f"tokens{args.tokens}", report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
