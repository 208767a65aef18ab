"""Where a model training step spends its GPU time: ``bench.bench_model``'s models and
variants, eager or compiled, the kernels of a few profiled steps summed by name and by kind
(GEMMs, fp8blk's quantize / norm / gating / MoE kernels, attention, inductor's and torch's
elementwise kernels, the optimizer, copies and fills).

    python3 -m bench.profile.profile_model_step --arch llama_1b --variants bf16,fp8blk_opt \\
        --modes compiled [--layers 16] [--steps 2] [--top 25] [--out FILE]

Each variant from a fresh state, as ``bench_model`` builds them (2 x 4096 tokens). The tables
go to stdout and ``--out``. Without CUDA (``--tiny`` on the CPU) the CPU operators are summed
instead: a smoke run of the script, no figures.
"""
from __future__ import annotations

import argparse
import gc
import re

import torch

from bench import bench_model
from bench.profile.profile_moe_block import _short

# kind <- the first pattern a kernel's name matches (names as torch.profiler gives them;
# fp8blk's Numba kernels carry their module's path in the mangled name)
KINDS = [
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|cublas|wgmma|grouped_gemm"),
    ("fp8blk quantize", r"quantize|_kernel\d*quant|transpose"),
    ("fp8blk norm", r"norm"),
    ("fp8blk gating / moe", r"silu|weighted_rows|gate"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy / fill", r"copy|memcpy|memset|fill|cat"),
    ("inductor (triton)", r"^triton"),
    ("elementwise / reduce (torch)", r"elementwise|reduce|index|scatter|gather|sort"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def profile_step(step, steps, cuda):
    """{kernel name: (calls per step, ms per step)} over `steps` profiled calls of `step`
    (the CPU operators' self time without CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
    act = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[act]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    sums = {}
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = ev.device_time_total if cuda else ev.self_cpu_time_total
        n, s = sums.get(_short(ev.name), (0, 0.0))
        sums[_short(ev.name)] = (n + 1, s + t)
    return {k: (n // steps, s / steps / 1e3) for k, (n, s) in sums.items()}


def report(title, sums, top):
    """Lines: the total, each kind's share, then the `top` kernels."""
    total = sum(ms for _, ms in sums.values()) or 1.0
    kinds = {}
    for name, (n, ms) in sums.items():
        k = kinds.setdefault(kind_of(name), [0, 0.0])
        k[0] += n
        k[1] += ms
    lines = [f"\n## {title}: {total:.2f} ms of kernels per step"]
    lines += [f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{n:<5d} {kind}"
              for kind, (n, ms) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    lines.append("  top kernels:")
    lines += [f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{n:<5d} [{kind_of(name)}] {name}"
              for name, (n, ms) in sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama_1b", choices=sorted(bench_model.WIDTHS))
    p.add_argument("--variants", default="bf16,fp8blk_opt")
    p.add_argument("--modes", default="compiled")
    p.add_argument("--layers", type=int)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke run)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    layers = args.layers or bench_model.LAYERS.get(args.arch, 8)
    head = f"# {torch.cuda.get_device_name() if cuda else 'cpu'} torch {torch.__version__} " \
           f"{args.arch} {layers} layers, {args.batch} x {args.seq} tokens"
    out = [head]
    print(head, flush=True)
    for mode in args.modes.split(","):
        for variant in args.variants.split(","):
            torch._dynamo.reset()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            model = bench_model.build_model(args.arch, variant, layers, args.seq, device,
                                            args.tiny)
            if mode != "eager":
                bench_model.compile_model(model, "layers", bench_model.MODES[mode])
            gen = torch.Generator(device=device).manual_seed(1)
            ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                                device=device, generator=gen)
            step, opt = bench_model.make_step(
                model, ids, graphs=bench_model.MODES[mode] == "reduce-overhead")
            lines = report(f"{variant} {mode}", profile_step(step, args.steps, cuda), args.top)
            print("\n".join(lines), flush=True)
            out += lines
            model = step = opt = None
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
