"""GPU benchmark of fp8blk.torch.Float8BlockLinear, one H200:

    python3 -m bench.bench_linear --out bench/results/linear-h200.json [--quick]
        [--speed-only] [--compile] [--shapes 0,1,2 | --shapes 8000x4096x4096,...] [--section S]

1. Accuracy: SQNR (dB) of the output, input gradient and weight gradient against bf16
   nn.Linear (same weights, inputs and output gradient; the fp32 GEMM of the same bf16 data as
   the signal) at widths 4096 and 8192 (8192 tokens, in = out = width). Target: output >= 25 dB.
2. Speed, fwd+bwd, (tokens, in, out) = (16384, 8192, 8192), (16384, 4096, 14336),
   (8192, 4096, 4096), bf16, no bias: Float8BlockLinear, bf16 nn.Linear, torchao 0.18
   ``torchao.prototype.blockwise_fp8_training.linear.Float8BlockwiseLinear`` when importable
   (its default GEMM path, and use_triton=True when that argument exists), and
   Float8BlockLinear with ``Float8BlockConfig(low_memory_forward=True)`` ("fp8blk_low_memory":
   the forward pass in halves, its FP8 copies of x made one at a time). GPU time: CUDA events
   around back-to-back iterations (median of repeats, the cases' repeats interleaved so that
   clock drift falls on all of them alike). Host time: wall time to issue one
   iteration of the same shape while the GPU is held by a sleep kernel queued first (so the
   launch queue never fills: the host alone; median of 9 x 10 iterations). GPU time alone:
   the same steps with a GPU sleep queued before each sample, so the host has issued them all
   before the GPU starts (the step's time without host gaps: what bounds the back-to-back
   figure when the host keeps up). CUDA graphs: each case's step captured in a CUDA graph and
   replayed back to back (the GPU work sustained, no host in the loop), bf16 and fp8blk.
   Targets: >= 1.5x bf16 at the two large shapes, >= 1.2x at the small one, faster than torchao.
3. Breakdown per shape, timed like the GPU time alone and interleaved with it: the three GEMMs
   alone (blockwise_scaled_mm on prequantized operands), the quantize kernels alone (x
   row+col, W row, dY row+col, W col), bf16's three GEMMs, and the rest.
4. Forward peak memory (max_memory_allocated during forward, above the start) and the bytes
   saved for backward, against bf16 nn.Linear, for the layer alone and for stacks of four and
   eight square (in -> in) layers (saved tensors add up across layers, transients do not).
5. torch.compile(fullgraph=True) of a 2-layer model on the GPU: traces, and equals eager.
Prints a table and writes its run (machine, date, command, per-case figures) as one section of
the ``--out`` file (``bench.write_section``: "runs" holds each section's run, "speed" every
section's cases, each tagged with its section). A run replaces its own section and leaves the
others: ``--section`` names it, by default "compile" with ``--compile``, else "default".
bench/results/linear-h200.json holds "default" (the full run), "compile" (``--speed-only
--compile --shapes 2``) and "unaligned" (``--quick --speed-only --shapes
16384x4096x11008,8000x4096x4096 --section unaligned``).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch

from bench import write_section
from fp8blk.torch import (Float8BlockLinear, blockwise_scaled_mm, release_scratch,
                          scratch_bytes)
from fp8blk.torch import Float8BlockConfig, convert_to_float8_block
from fp8blk.torch.scaled_mm import cublaslt_status
from fp8blk.torch.linear import functional as fl
from fp8blk.torch.linear.functional import block2d_columnwise, quantize_buffers

SHAPES = [(16384, 8192, 8192), (16384, 4096, 14336), (8192, 4096, 4096)]
TARGETS = {SHAPES[0]: 1.5, SHAPES[1]: 1.5, SHAPES[2]: 1.2}
DEV = "cuda"


LOW_MEMORY = Float8BlockConfig(low_memory_forward=True)


def sample_ms(fn, inner, prefill_ms=None, host_loop=None):
    """ms per call of one sample: `inner` back-to-back calls between CUDA events, behind a GPU
    sleep of `prefill_ms` (see :func:`interleaved_ms`) when given. `host_loop`, a list, gets the
    host's wall us per call of the issuing loop (in a host-bound sample, about the step)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if prefill_ms:
        sleep_ms(prefill_ms)
    start.record()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    if host_loop is not None:
        host_loop.append((time.perf_counter() - t0) / inner * 1e6)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / inner


def gpu_ms(fn, inner=10, repeats=7, warmup=3):
    """Median ms per call over `repeats` runs of `inner` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(sample_ms(fn, inner) for _ in range(repeats))


_sleep_cycles_per_ms = []


def sleep_ms(ms):
    """Queue a GPU sleep kernel of about `ms` milliseconds (its cycles per ms measured once)."""
    if not _sleep_cycles_per_ms:
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        stop.record()
        stop.synchronize()
        _sleep_cycles_per_ms.append(20_000_000 / start.elapsed_time(stop))
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms[0]))


def interleaved_ms(fns, inner=10, repeats=7, warmup=3, prefill_ms=None, host_out=None):
    """{name: median ms per call} of several callables timed like :func:`gpu_ms`, one repeat
    of each in turn (the order rotated per round): FP8 and bf16 GEMMs are power bound and the
    GPU's clocks drift over a run, so timing the cases one after the other biases their
    ratios by a few percent.

    `prefill_ms`: a GPU sleep of that many ms is queued before each sample's start event, so
    the host issues all `inner` calls while the GPU sleeps and the sample times the GPU work
    alone (no host gaps; the sleep must outlast the issuing: the caller sizes it).
    `host_out`, a dict, gets {name: median host us per call of the issuing loops}."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    names = list(fns)
    samples = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(sample_ms(fns[name], inner, prefill_ms, host[name]))
    if host_out is not None:
        host_out.update({n: statistics.median(v) for n, v in host.items()})
    return {n: statistics.median(v) for n, v in samples.items()}


def host_us(fn, n=10, repeats=9):
    """Host us to issue one call at the real shape: the median over `repeats` of `n` calls
    issued while the GPU runs a ~30 ms sleep kernel queued first, so the launch queue never
    fills and the loop measures the host alone (a back-to-back loop of GPU-bound steps would
    measure the GPU)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda._sleep(60_000_000)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def sqnr_db(ref, test):
    ref, test = ref.double(), test.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - test).pow(2).sum()))


def fwd_bwd(layer, x, g):
    def step():
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(g)
    return step


def graphed(step):
    """`step` captured in a CUDA graph (warmed up on a side stream first, as torch's docs ask):
    a callable that replays it. A replayed step costs the host one launch, so back-to-back
    replays time the GPU work, sustained (no host gaps, the clocks of a long run)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def torchao_layers(k, n):
    """{name: layer} of torchao's Float8BlockwiseLinear variants, or {} / an error string."""
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except Exception as err:  # noqa: BLE001  (report why, keep benchmarking)
        return {}, f"torchao not importable: {type(err).__name__}: {err}"
    out = {}
    base = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
    layer = Float8BlockwiseLinear.from_float(base)
    out["torchao"] = layer
    if hasattr(layer, "use_triton"):
        tri = Float8BlockwiseLinear.from_float(base)
        tri.use_triton = True
        out["torchao_triton"] = tri
    return out, None


def accuracy(width, tokens=8192):
    gen = torch.Generator(device=DEV).manual_seed(width)
    x = torch.randn(tokens, width, device=DEV, dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, width, device=DEV, dtype=torch.bfloat16, generator=gen)
    ref = torch.nn.Linear(width, width, bias=False, device=DEV, dtype=torch.bfloat16)
    fp8 = Float8BlockLinear.from_linear(ref)
    out = {}
    for name, layer in (("ref", ref), ("fp8", fp8)):
        xi = x.clone().requires_grad_(True)
        layer.weight.grad = None
        y = layer(xi)
        y.backward(g)
        out[name] = (y.detach(), xi.grad, layer.weight.grad.clone())
    # signal: the exact (fp32) products of the same bf16 data
    w = ref.weight.detach().float()
    exact = (x.float() @ w.t(), g.float() @ w, g.float().t() @ x.float())
    return {"width": width, "tokens": tokens,
            "sqnr_db": {k: sqnr_db(e, t) for k, e, t in
                        zip(("output", "input_grad", "weight_grad"), exact, out["fp8"])},
            "bf16_sqnr_db": {k: sqnr_db(e, t) for k, e, t in
                             zip(("output", "input_grad", "weight_grad"), exact, out["ref"])}}


def step_operands(m, k, n):
    """A (tokens m, in k, out n) step's data under the default config: ``(cfg, (x, w, dy),
    gemms)`` with bf16 x (m, k), W (n, k), dY (m, n) and ``gemms`` {"fwd", "dgrad", "wgrad":
    blockwise_scaled_mm's operands}, quantized as a step quantizes them."""
    cfg = Float8BlockConfig()
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    qx = quantize_buffers(x, cfg.activation, True, True)
    qw = quantize_buffers(w, cfg.weight, True, False)
    qdy = quantize_buffers(dy, cfg.grad, True, True)
    qwt = block2d_columnwise(qw[0], qw[1], cfg.weight)
    return cfg, (x, w, dy), {
        "fwd": fl.forward_operands(qx, qw, cfg),
        "dgrad": fl.dgrad_operands(qdy, qwt, cfg),
        "wgrad": fl.wgrad_operands((qdy[2], qdy[3]), (qx[2], qx[3]), cfg)}


def breakdown_fns(m, k, n):
    """{name: callable} of the pieces of a step, timed beside the steps: the three GEMMs
    alone on prequantized operands, the four quantize kernels alone (x row+col, W row, dY
    row+col, W col: what a planned step launches), bf16's three GEMMs."""
    cfg, (x, w, dy), ops = step_operands(m, k, n)

    def gemms():
        for o in ops.values():
            blockwise_scaled_mm(*o, out_dtype=torch.bfloat16)

    def quants():
        quantize_buffers(x, cfg.activation, True, True)
        quantize_buffers(w, cfg.weight, True, False)
        quantize_buffers(dy, cfg.grad, True, True)
        quantize_buffers(w, cfg.weight, False, True)

    def bf16_gemms():
        x @ w.t()
        dy @ w
        dy.t() @ x
    return {"gemms": gemms, "quantize": quants, "bf16_gemms": bf16_gemms}


def memory(layer, x):
    """(forward peak bytes above the start, bytes held after forward for backward). The layer
    gets ``x * 1.0``, a fresh activation nothing else keeps (as in a network, where the
    previous op's output lives on only if the layer saves it; a scalar mul saves nothing):
    nn.Linear keeps it (2 bytes/element in bf16), Float8BlockLinear keeps x's FP8 columnwise
    copy (1 byte/element + scales) and W's FP8 tiles (N*K bytes)."""
    release_scratch()       # fp8blk's transients count in the peak, not in what is held
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = layer(x * 1.0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = (torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
            - scratch_bytes())
    del y
    return peak, held


def stack_memory(m, k, depth=4):
    """Forward peak bytes (above the start) of `depth` square (k -> k) layers in sequence, per
    implementation: what a network's forward pass holds. Each layer's saved tensors stay
    alive until backward (so they add up across layers), while a layer's transient buffers
    (its FP8 copies of the input that are not saved) are freed before the next layer runs."""
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    builders = {"bf16": lambda lin: lin, "fp8blk": Float8BlockLinear.from_linear,
                "fp8blk_low_memory": lambda lin: Float8BlockLinear.from_linear(lin, LOW_MEMORY)}
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        builders["torchao"] = Float8BlockwiseLinear.from_float
    except Exception:  # noqa: BLE001  (reported by speed())
        pass
    for name, build in builders.items():
        try:
            stack = torch.nn.Sequential(*[build(torch.nn.Linear(
                k, k, bias=False, device=DEV, dtype=torch.bfloat16)) for _ in range(depth)])
            out[name] = memory(stack, x)[0]
            del stack
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}"
    return {"depth": depth, "tokens": m, "width": k, "fwd_peak_bytes": out}


def speed(m, k, n, quick, speed_only=False, inner=None, compiled=False):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
    layers = {"bf16": bf16, "fp8blk": Float8BlockLinear.from_linear(bf16),
              "fp8blk_low_memory": Float8BlockLinear.from_linear(bf16, LOW_MEMORY)}
    ao, ao_error = torchao_layers(k, n)
    for name, layer in ao.items():
        layer.weight = bf16.weight
        layers[name] = layer
    if compiled:   # each case under torch.compile (inductor), as torchao's users run it
        layers = {name: torch.compile(layer) for name, layer in layers.items()
                  if name != "torchao_triton"}
    case = {"tokens": m, "in": k, "out": n, "compiled": compiled, "torchao_error": ao_error,
            "gpu_ms": {},
            "host_us": {}, "fwd_peak_bytes": {}, "saved_bytes": {}, "errors": {}}
    steps = {}
    for name, layer in layers.items():
        try:
            step = fwd_bwd(layer, x, g)
            step()  # a peer that fails here is left out of the timing
            steps[name] = step
            case["host_us"][name] = host_us(step)
            if not speed_only:
                peak, held = memory(layer, x)
                case["fwd_peak_bytes"][name], case["saved_bytes"][name] = peak, held
        except Exception as err:  # noqa: BLE001  (a peer failing must not hide our numbers)
            case["errors"][name] = f"{type(err).__name__}: {err}"
            steps.pop(name, None)
    case["inner"] = inner = inner or (3 if quick else 10)
    # host_loop_us: the host's us per step while issuing the back-to-back samples; beside
    # host_us (issued behind a sleeping GPU) it shows whether the back-to-back loop waited on
    # the host
    case["host_loop_us"] = {}
    case["gpu_ms"] = interleaved_ms(steps, inner=inner, host_out=case["host_loop_us"])
    t = case["gpu_ms"]
    case["speedup_vs_bf16"] = t["bf16"] / t["fp8blk"] if "fp8blk" in t else None
    case["target_vs_bf16"] = TARGETS.get((m, k, n))
    case["speedup_vs_torchao"] = {p: t[p] / t["fp8blk"] for p in t if p.startswith("torchao")}
    if "fp8blk_low_memory" in t:
        lm = t["fp8blk_low_memory"]
        case["low_memory_forward"] = {"speedup_vs_bf16": t["bf16"] / lm, "speedup_vs_torchao": {
            p: t[p] / lm for p in t if p.startswith("torchao")}}
    # the same steps with the GPU queue filled first (the GPU work alone: what the step would
    # take with no host gaps), beside the pieces of a step, all interleaved
    pieces = breakdown_fns(m, k, n)
    prefill = 2 + 1.5 * inner * max(case["host_us"].values()) / 1000
    alone = interleaved_ms({**steps, **pieces}, inner=inner, prefill_ms=prefill)
    case["gpu_alone_ms"] = {p: alone[p] for p in steps}
    case["gpu_alone_speedup_vs_bf16"] = (alone["bf16"] / alone["fp8blk"]
                                         if "fp8blk" in alone else None)
    case["prefill_ms"] = prefill
    # the same steps captured in CUDA graphs and replayed back to back: sustained GPU work
    # with no host in the loop (what torch.cuda.graph or torch.compile(mode="reduce-overhead")
    # give a user whose step is host-bound)
    replays = {}
    for name, step in steps.items():
        if name not in ("bf16", "fp8blk"):   # a peer's failed capture could upset the rest
            continue
        try:
            replays[name] = graphed(step)
        except Exception as err:  # noqa: BLE001
            case["errors"][f"{name} graphed"] = f"{type(err).__name__}: {err}"
    case["graphed_ms"] = interleaved_ms(replays, inner=inner)
    graphs = case["graphed_ms"]
    case["graphed_speedup_vs_bf16"] = (graphs["bf16"] / graphs["fp8blk"]
                                       if "fp8blk" in graphs and "bf16" in graphs else None)
    del replays
    case["stack_memory"] = [] if speed_only else [stack_memory(m, k, depth) for depth in (4, 8)]
    case["breakdown"] = {f"{p}_ms": alone[p] for p in pieces}
    case["breakdown"]["other_ms"] = alone.get("fp8blk", 0) - alone["gemms"] - alone["quantize"]
    flops = 6 * m * k * n
    case["tflops"] = {p: flops / (ms * 1e-3) / 1e12 for p, ms in t.items()}
    return case


def compile_check():
    """torch.compile(fullgraph=True) on the GPU: with aot_eager (the same kernels: must equal
    eager bit for bit) and with inductor (fuses the pointwise ops around the layer, which
    skips intermediate bf16 roundings: reported as the max difference), forward+backward."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048, device=DEV, dtype=torch.bfloat16),
                                torch.nn.GELU(),
                                torch.nn.Linear(2048, 1024, device=DEV, dtype=torch.bfloat16))
    convert_to_float8_block(model, share_quantize=False)    # the layers alone
    x = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16)
    out = {}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                eager = model(x)
                compiled = torch.compile(model, fullgraph=True, backend=backend)(x)
            xc = x.clone().requires_grad_(True)
            torch.compile(model, fullgraph=True, backend=backend)(xc).float().sum().backward()
            out[backend] = {"fullgraph": True, "equal_to_eager": bool(torch.equal(eager, compiled)),
                            "max_abs_diff": float((eager - compiled).abs().max())}
        except Exception as err:  # noqa: BLE001
            out[backend] = {"fullgraph": False, "error": f"{type(err).__name__}: {err}"}
    return out


def _us(d):
    return "{" + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) + "}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--speed-only", action="store_true",
                        help="only the speed cases: no accuracy, memory or compile checks")
    parser.add_argument("--inner", type=int, default=None,
                        help="fwd+bwd iterations per timed sample (default 10, 3 with --quick); "
                             "few iterations expose the pipeline fill of each sample")
    parser.add_argument("--compile", action="store_true",
                        help="time each case under torch.compile (inductor; torchao's Triton "
                             "variant left out); use with --speed-only")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated indices into SHAPES, or shapes as "
                             "TOKENSxINxOUT (default: all of SHAPES)")
    parser.add_argument("--section", default=None,
                        help="the --out file's section this run replaces (default: "
                             "'compile' with --compile, else 'default')")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes is None else [
        tuple(map(int, s.split("x"))) if "x" in s else SHAPES[int(s)]
        for s in args.shapes.split(",")]
    result = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                          "torch": torch.__version__, "python": platform.python_version()},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([sys.executable] + sys.argv),
              "cublaslt_gemms": cublaslt_status()["enabled"],   # the plan's GEMMs (FP8BLK_CUBLASLT)
              "accuracy": [] if args.speed_only else [accuracy(w) for w in (4096, 8192)],
              "speed": [speed(*s, args.quick, args.speed_only, args.inner, args.compile)
                        for s in shapes],
              "compile": {} if args.speed_only else compile_check()}
    for a in result["accuracy"]:
        s = a["sqnr_db"]
        print(f"SQNR width {a['width']}: out {s['output']:.1f} dB, dgrad {s['input_grad']:.1f} "
              f"dB, wgrad {s['weight_grad']:.1f} dB (bf16: {a['bf16_sqnr_db']['output']:.1f})"
              f"  target out >= 25: {'OK' if s['output'] >= 25 else 'MISSED'}")
    for c in result["speed"]:
        t = c["gpu_ms"]
        peers = " ".join(f"{p} {ms:.3f}" for p, ms in t.items())
        ao = " ".join(f"x{v:.2f} vs {p}" for p, v in c["speedup_vs_torchao"].items())
        b = c["breakdown"]
        alone = " ".join(f"{p} {ms:.3f}" for p, ms in c["gpu_alone_ms"].items())
        print(f"({c['tokens']}, {c['in']}, {c['out']}) ms: {peers} | x{c['speedup_vs_bf16']:.2f} "
              f"vs bf16 (target {c['target_vs_bf16']}) {ao} | GPU alone (queue filled first) "
              f"{alone} x{c['gpu_alone_speedup_vs_bf16']:.2f} | CUDA graphs "
              f"{' '.join(f'{p} {ms:.3f}' for p, ms in c['graphed_ms'].items())} "
              f"x{c['graphed_speedup_vs_bf16'] or 0:.2f} | gemms {b['gemms_ms']:.3f} "
              f"quant {b['quantize_ms']:.3f} other {b['other_ms']:.3f} (bf16 gemms "
              f"{b['bf16_gemms_ms']:.3f}) | host us {_us(c['host_us'])} (in the back-to-back loop "
              f"{_us(c['host_loop_us'])}) | fwd peak "
              f"{c['fwd_peak_bytes']} saved {c['saved_bytes']} | low_memory_forward "
              f"{c.get('low_memory_forward')} | stack fwd peak "
              f"{[(s['depth'], s['fwd_peak_bytes']) for s in c['stack_memory']]} | errors "
              f"{c['errors']} "
              f"{c['torchao_error'] or ''}")
    print("compile:", result["compile"])
    status = cublaslt_status()
    print("plan GEMMs on", "cuBLASLt directly" if status["enabled"] else "torch._scaled_mm",
          f"(cuBLASLt refusals: {status['refusals']})")
    if args.out:
        section = args.section or ("compile" if args.compile else "default")
        write_section(args.out, section, result, cases="speed")
        print("wrote", args.out, "section", section)


if __name__ == "__main__":
    main()
