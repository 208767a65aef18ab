"""Expert parallelism: the FP8 token dispatch against a bf16 one, and an expert-parallel MoE
block against the bf16 block, one rank per GPU (NCCL) or on CPU ranks (gloo, ``--device cpu``):

    torchrun --standalone --nproc-per-node N -m bench.bench_ep --out bench/results/ep-h200.json
    # CPU smoke run (tests/bench/test_bench_ep.py): --device cpu --hidden 256 --intermediate 128
    #   --experts 8 --top-k 2 --tokens 64 --steps 1 --warmup 1 --inner 1

1. Dispatch / combine (``--parts dispatch``). Each rank routes ``--tokens`` tokens top-k to E
   experts spread evenly over the P ranks (experts [r*E/P, (r+1)*E/P) on rank r), balanced
   (each token's k experts uniform, without replacement) and skewed (a quarter of the experts
   get no token, expert 0 four times the mean: rank 0 receives the most), with
   ``bench.bench_moe.routing_ids``. Its rows are the (token, expert) pairs sorted by expert,
   hence grouped by destination rank. Cases, per shape and routing:

     fp8_pow2   ``fb.comm.quantized_all_to_all`` with ``fb.Block1D()`` (one byte per scale)
     fp8_fp32   the same with ``fb.Block1D(pow2_scales=False)`` (fp32 scales)
     bf16       ``fb.comm.high_precision_all_to_all`` of the same bf16 rows
     combine    ``high_precision_all_to_all`` of the received bf16 rows back (counts
                transposed): what every dispatch above is followed by

   Before timing, each FP8 case checks once that its received rows are byte for byte
   ``fb.quantize`` of the rows the bf16 dispatch received (``byte_check``).

2. The MoE block (``--parts layer``): transformers' ``Qwen3MoeSparseMoeBlock`` /
   ``MixtralSparseMoeBlock`` from a config of the shape's widths, forward + backward of the
   rank's tokens, router included:

     bf16           the whole block on every rank, transformers' ``grouped_mm`` experts
     fp8blk         the whole block converted (``fp8blk.torch.moe.convert_experts``), no EP
     ep_fp8         converted, then ``fp8blk.torch.moe.expert_parallel(block, comm,
                    fp8_dispatch=True)``: this rank's E/P experts, tokens dispatched in FP8
     ep_bf16        the same with ``fp8_dispatch=False`` (bf16 dispatch)

   ``out_diff_vs_fp8blk``: max |y - y_fp8blk| / max |y_fp8blk| of one forward of the rank's
   tokens, y_fp8blk the converted whole block's output (rounding only, for the EP cases).

   Every rank builds the same full block (one seed) before ``expert_parallel`` keeps its
   experts; each rank's tokens are its own.

Timing, both parts: every case is built first; then ``--steps`` rounds each time one sample
of every case, the order rotated per round (clock drift falls on all alike), every sample
starting after a barrier (a collective's time then holds no wait for a late peer's start).
A sample: ``--inner`` back-to-back calls between CUDA events (GPU ms per call) and the host's
wall time to issue them (host ms per call; the metadata collective of every all-to-all is
synchronous, so host time includes the peers' host time up to it). On the CPU there are no
events: GPU fields are null. Bytes per call: this rank's ``comm.stats`` over one call, the
data collective (``bytes_sent``, the bytes this rank sends, its own block included) apart from
the metadata collective (``meta_bytes_sent``). Figures are rank 0's, with every rank's in the
``*_per_rank`` fields; ``*_vs_bf16``: a figure over its bf16 peer's (the bf16 dispatch, the
bf16 block), ``bytes_sent_vs_bf16_max_rank`` the worst rank's. Memory (layer): the block's
parameter bytes on this rank (``param_gib``) and, on CUDA, one more step per case: the
allocator's peak above what was allocated before it (``step_peak_gib``).

On one rank the all-to-all is a local copy (no link): the run shows that the script works,
not what the dispatch costs (the JSON's ``note`` says so). Writes its run (machine, date,
command, cases) as section ``--section`` of ``--out`` (``bench.write_section``); a folder as
``--out`` gets ``ep-<machine>.json`` (``h200``, ``h200x4``; ``cpu``, ``cpux2``).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import fp8blk as fb
from bench import machine, write_section
from bench.bench_moe import BLOCKS, routing_ids


def _widths(block):
    """A bench_moe block's model type and widths under this script's names (the two model
    types name the expert width and count differently)."""
    return dict(model=block["model"], hidden=block["hidden_size"],
                intermediate=block.get("moe_intermediate_size", block.get("intermediate_size")),
                experts=block.get("num_experts", block.get("num_local_experts")),
                top_k=block["num_experts_per_tok"])


SHAPES = {name: _widths(block) for name, block in BLOCKS.items()}
DISPATCH_CASES = ("fp8_pow2", "fp8_fp32", "bf16", "combine")
LAYER_CASES = ("bf16", "fp8blk", "ep_fp8", "ep_bf16")
RECIPES = {"fp8_pow2": fb.Block1D(), "fp8_fp32": fb.Block1D(pow2_scales=False)}


class Env:
    """The run's process group, communicator and device."""

    def __init__(self, device):
        self.cuda = device == "cuda"
        if self.cuda:  # before the process group, so NCCL binds each rank to its own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if self.cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.cuda
                       else torch.device("cpu"))
        self.comm = fb.comm.TorchComm()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()


def shape_of(name, args):
    """A shape's widths with the command line's overrides (the CI's tiny run)."""
    spec = dict(SHAPES[name])
    for key in ("hidden", "intermediate", "experts", "top_k"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    return spec


def check_shape(name, spec, world):
    if spec["experts"] % world:
        raise SystemExit(f"{name}: {spec['experts']} experts do not spread evenly over "
                         f"{world} ranks")
    live = spec["experts"] - spec["experts"] // 4
    if spec["top_k"] > live:
        raise SystemExit(f"{name}: top-{spec['top_k']} needs at least that many experts with "
                         f"tokens; skewed routing leaves {live} of {spec['experts']}")


# -- timing ------------------------------------------------------------------------------------
def time_cases(fns, env, steps, inner):
    """{name: (GPU ms per call or None, host ms per call)}, medians over ``steps`` rounds of
    one sample per case (see the module docstring)."""
    names = list(fns)
    gpu = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            env.sync()
            if env.cuda:
                start, stop = (torch.cuda.Event(enable_timing=True),
                               torch.cuda.Event(enable_timing=True))
                start.record()
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            host[name].append((time.perf_counter() - t0) * 1e3 / inner)
            if env.cuda:
                stop.record()
                stop.synchronize()
                gpu[name].append(start.elapsed_time(stop) / inner)
    med = statistics.median
    return {n: (med(gpu[n]) if gpu[n] else None, med(host[n])) for n in names}


def sent_bytes(env, fn, op):
    """(data bytes, metadata bytes) this rank sends in one call of ``fn`` (``comm.stats``)."""
    env.comm.reset_stats()
    fn()
    stats = env.comm.stats
    return stats.ops.get(op, [0, 0])[1], stats.meta_bytes


# -- part 1: dispatch and combine --------------------------------------------------------------
def dispatch_rows(spec, tokens, skewed, env):
    """(rows (N, H) bf16 grouped by destination rank, send counts): this rank's (token,
    expert) pairs sorted by expert."""
    gen = torch.Generator().manual_seed(1000 * env.rank + skewed)
    ids = routing_ids(tokens, spec["top_k"], spec["experts"], skewed, gen).reshape(-1)
    order = torch.sort(ids, stable=True).indices
    per_rank = spec["experts"] // env.world
    counts = torch.bincount(ids // per_rank, minlength=env.world).tolist()
    hidden = torch.randn(tokens, spec["hidden"], generator=gen)
    rows = hidden[order // spec["top_k"]].to(env.device, torch.bfloat16).contiguous()
    return rows, counts


def dispatch_cases(name, spec, skewed, args, env):
    rows, send = dispatch_rows(spec, args.tokens, skewed, env)
    comm = env.comm
    received, recv, _ = fb.comm.high_precision_all_to_all(rows, comm, send)
    fns = {
        "fp8_pow2": lambda: fb.comm.quantized_all_to_all(rows, comm, send, RECIPES["fp8_pow2"]),
        "fp8_fp32": lambda: fb.comm.quantized_all_to_all(rows, comm, send, RECIPES["fp8_fp32"]),
        "bf16": lambda: fb.comm.high_precision_all_to_all(rows, comm, send),
        "combine": lambda: fb.comm.high_precision_all_to_all(received, comm, recv,
                                                             recv_counts=send),
    }
    ops = {"fp8_pow2": "quantized_all_to_all", "fp8_fp32": "quantized_all_to_all",
           "bf16": "high_precision_all_to_all", "combine": "high_precision_all_to_all"}
    checks = {}
    for case, recipe in RECIPES.items():
        q = fns[case]()[0]
        want = fb.quantize(received, recipe)
        checks[case] = bool(torch.equal(q.rowwise_data, want.rowwise_data)
                            and torch.equal(q.rowwise_scale_inv, want.rowwise_scale_inv))
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    sent = {case: sent_bytes(env, fns[case], ops[case]) for case in fns}
    times = time_cases(fns, env, args.steps, args.inner)
    out = []
    for case in fns:
        gpu, host = times[case]
        out.append(dict(part="dispatch", shape=name, routing="skewed" if skewed else "balanced",
                        case=case, tokens=args.tokens, hidden=spec["hidden"],
                        experts=spec["experts"], top_k=spec["top_k"],
                        rows_sent=len(rows) if case != "combine" else sum(recv),
                        rows_received=sum(recv) if case != "combine" else len(rows),
                        gpu_ms=gpu, host_ms=host, bytes_sent=sent[case][0],
                        meta_bytes_sent=sent[case][1], byte_check=checks.get(case)))
    return out


# -- part 2: the MoE block ---------------------------------------------------------------------
def hf_config(spec):
    import transformers

    common = dict(hidden_size=spec["hidden"], num_experts_per_tok=spec["top_k"],
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128)
    if spec["model"] == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=spec["intermediate"],
                                          num_experts=spec["experts"], **common)
    else:
        cfg = transformers.MixtralConfig(intermediate_size=spec["intermediate"],
                                         num_local_experts=spec["experts"], **common)
    # the bf16 baseline is transformers' grouped GEMM (the converter keeps it as the fallback)
    cfg._experts_implementation = "grouped_mm"
    return cfg


def build_block(spec, case, env):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from fp8blk.torch.moe import convert_experts

    cls = Qwen3MoeSparseMoeBlock if spec["model"] == "qwen3_moe" else MixtralSparseMoeBlock
    cfg = hf_config(spec)
    with torch.device(env.device):
        block = cls(cfg)
    # a block made alone keeps the experts' torch.empty parameters (transformers initializes
    # weights in its models' post_init): drawn here as the models draw them, from one seed, so
    # that every rank holds the same full block before expert_parallel keeps its experts
    torch.manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, cfg.initializer_range)
    block = block.to(torch.bfloat16)
    if case != "bf16":
        convert_experts(block)
    if case in ("ep_fp8", "ep_bf16"):
        from fp8blk.torch.moe import expert_parallel
        expert_parallel(block, env.comm, fp8_dispatch=case == "ep_fp8")
    return block


def layer_cases(name, spec, args, env):
    gen = torch.Generator().manual_seed(2000 + env.rank)
    x = torch.randn(1, args.tokens, spec["hidden"], generator=gen)
    x = x.to(env.device, torch.bfloat16).requires_grad_(True)
    g = torch.randn(x.shape, generator=gen).to(env.device, torch.bfloat16)
    blocks = {case: build_block(spec, case, env) for case in args.layer_cases}

    def stepper(block):
        def step():
            for p in block.parameters():
                p.grad = None
            x.grad = None
            y = block(x)
            (y[0] if isinstance(y, tuple) else y).backward(g)
        return step

    fns = {case: stepper(b) for case, b in blocks.items()}
    # a sanity figure, not a parity test (tests/torch/moe has those): an expert-parallel block
    # computes what the whole converted block does up to rounding; a wrong shard or a token
    # sent to the wrong rank shows as a difference of the outputs' own size
    outs = {}
    with torch.no_grad():
        for case, block in blocks.items():
            y = block(x)
            outs[case] = (y[0] if isinstance(y, tuple) else y).float()
    ref = outs.get("fp8blk")
    diffs = {case: float((y - ref).abs().max() / ref.abs().max()) if ref is not None else None
             for case, y in outs.items()}
    del outs, ref
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    peaks = {}
    for case, fn in fns.items():
        if env.cuda:
            env.sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peaks[case] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
        else:
            fn()  # every rank runs as many steps (collectives)
    times = time_cases(fns, env, args.steps, args.inner)
    out = []
    for case, block in blocks.items():
        gpu, host = times[case]
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        out.append(dict(part="layer", shape=name, case=case, tokens=args.tokens,
                        hidden=spec["hidden"], intermediate=spec["intermediate"],
                        experts=spec["experts"], top_k=spec["top_k"], gpu_ms=gpu,
                        host_ms=host, param_gib=params / 2 ** 30,
                        step_peak_gib=peaks.get(case), out_diff_vs_fp8blk=diffs[case]))
    return out


# -- report ------------------------------------------------------------------------------------
def ratios(cases):
    """Add ``<figure>_vs_bf16`` to every dispatch case and every layer case (not the combine,
    which has no bf16 counterpart): its figure over its bf16 peer's (same part, shape and
    routing), rank 0's; and ``bytes_sent_vs_bf16_max_rank``, the worst rank's byte ratio,
    which the wire format bounds."""
    def peer_key(c):
        return c["part"], c["shape"], c.get("routing")
    base = {peer_key(c): c for c in cases if c["case"] == "bf16"}
    for c in cases:
        b = base.get(peer_key(c)) if c["case"] != "combine" else None
        for key in ("gpu_ms", "host_ms", "bytes_sent"):
            if key not in c:
                continue
            mine, theirs = c[key], b[key] if b else None
            c[f"{key}_vs_bf16"] = mine / theirs if mine is not None and theirs else None
        if "bytes_sent" in c:
            per = [m / t for m, t in zip(c["bytes_sent_per_rank"], b["bytes_sent_per_rank"])
                   if t] if b else []
            c["bytes_sent_vs_bf16_max_rank"] = max(per) if per else None


def merge_ranks(mine, env):
    """Rank 0's cases with every rank's bytes and times added (``*_per_rank``)."""
    every = [None] * env.world
    dist.all_gather_object(every, mine)
    merged = []
    for i, c in enumerate(every[0]):
        c = dict(c)
        for key in ("gpu_ms", "host_ms", "bytes_sent", "step_peak_gib", "byte_check",
                    "out_diff_vs_fp8blk"):
            if key in c:
                c[f"{key}_per_rank"] = [r[i].get(key) for r in every]
        merged.append(c)
    return merged


def report_line(c):
    gpu = "-" if c["gpu_ms"] is None else f"{c['gpu_ms']:.3f}"
    text = (f"{c['part']:8s} {c['shape']:10s} {c.get('routing', ''):8s} {c['case']:8s} "
            f"GPU {gpu} ms  host {c['host_ms']:.3f} ms")
    if c["part"] == "dispatch":
        text += (f"  sent {c['bytes_sent']} B (x{c['bytes_sent_vs_bf16']:.4f} bf16)"
                 if c["bytes_sent_vs_bf16"] is not None else f"  sent {c['bytes_sent']} B")
    else:
        if c["step_peak_gib"] is not None:
            text += f"  peak +{c['step_peak_gib']:.3f} GiB"
        if c["out_diff_vs_fp8blk"] is not None:
            text += f"  out diff {c['out_diff_vs_fp8blk']:.1e}"
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--parts", default="dispatch,layer")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--hidden", type=int, help="override every shape's hidden size")
    p.add_argument("--intermediate", type=int, help="override every shape's expert width")
    p.add_argument("--experts", type=int, help="override every shape's expert count")
    p.add_argument("--top-k", type=int, help="override every shape's top-k")
    p.add_argument("--layer-cases", default=",".join(LAYER_CASES))
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    p.add_argument("--inner", type=int, default=5, help="calls per timed sample")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--section", default=None, help="the run's section (default tokens<T>)")
    p.add_argument("--out", help="JSON path, or a folder for ep-<machine>.json (rank 0 writes)")
    args = p.parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    shapes = [s for s in args.shapes.split(",") if s]
    args.layer_cases = [s for s in args.layer_cases.split(",") if s]
    for what, got, known in (("part", parts, ("dispatch", "layer")), ("shape", shapes, SHAPES),
                             ("layer case", args.layer_cases, LAYER_CASES)):
        bad = [s for s in got if s not in known]
        if bad:
            p.error(f"unknown {what} {bad}; known: {list(known)}")
    env = Env(args.device)
    mine = []
    for name in shapes:
        spec = shape_of(name, args)
        check_shape(name, spec, env.world)
        if "dispatch" in parts:
            for skewed in (False, True):
                mine += dispatch_cases(name, spec, skewed, args, env)
                gc.collect()
        if "layer" in parts:
            mine += layer_cases(name, spec, args, env)
            gc.collect()
            if env.cuda:
                torch.cuda.empty_cache()
    cases = merge_ranks(mine, env)
    ratios(cases)
    if env.rank == 0:
        gpu = torch.cuda.get_device_name() if env.cuda else "cpu"
        run = dict(machine=machine(gpu, env.world), gpu=gpu if env.cuda else None,
                   world=env.world, backend=str(dist.get_backend()), host=platform.node(),
                   torch=torch.__version__,
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   command="torchrun --nproc-per-node {} -m bench.bench_ep {}".format(
                       env.world, " ".join(argv if argv is not None else sys.argv[1:])),
                   cases=cases)
        if env.world == 1:
            run["note"] = ("one rank: every all-to-all is a local copy (no link), so the "
                           "figures show that the script works, not what a dispatch costs")
        for c in cases:
            print(report_line(c), flush=True)
        if args.out:
            path = args.out
            if os.path.isdir(path) or path.endswith(os.sep):
                path = os.path.join(path, f"ep-{run['machine']}.json")
            write_section(path, args.section or f"tokens{args.tokens}", run)
            print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
