"""GPU benchmark of fp8blk's mixture-of-experts path (``fp8blk.torch.moe``), one GPU:

    python3 -m bench.bench_moe --out bench/results/moe-h200.json [--quick] [--section S]

1. Grouped GEMMs, quantization included, against bf16 ``torch._grouped_mm`` (or
   ``torch.nn.functional.grouped_mm``) in the same run, TFLOP/s (of the routed rows, padding
   not counted) and ratio: forward (x 1x128 row+col quantize, W 128x128 quantize, the GEMMs),
   input gradient (dY quantize, W.T, the GEMMs), weight gradient (the k-grouped GEMMs on the
   columnwise buffers). Shapes: Mixtral-8x7B's gate/up projection (8 experts, 4096 -> 2*14336,
   top-2 of 16384 tokens) and down projection (14336 -> 4096), Qwen3-30B-A3B's (128 experts,
   2048 -> 2*768 and 768 -> 2048, top-8 of 8192 tokens). Routing balanced (each token's k
   experts drawn without replacement, uniformly) and skewed (a quarter of the experts get no
   token, one gets 4x the mean).
2. One MoE block forward+backward (transformers' ``Qwen3MoeSparseMoeBlock`` /
   ``MixtralSparseMoeBlock`` built from a config with those widths, router included), bf16
   with transformers' ``grouped_mm`` experts against the same block converted by
   ``fp8blk.torch.moe.convert_experts``, balanced routing from the block's own router; the
   parameters' gradients set to None after each step, as a training step's zero_grad does.

GPU time: CUDA events around back-to-back calls, the variants interleaved
(``bench.bench_linear.interleaved_ms``). Host time: wall time per call of the issuing loop
(the per-expert path synchronizes with the device once per routing, so a call's host time is
not separable from the GPU's there: reported as measured). Each variant from a fresh state.
Writes its run as a section of ``--out`` (``bench.write_section``).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import platform
import sys

import torch

from bench import write_section
from bench.bench_linear import interleaved_ms

SHAPES = {
    # name: (experts, top_k, tokens, in_features, out_features)
    "mixtral_gate_up": (8, 2, 16384, 4096, 2 * 14336),
    "mixtral_down": (8, 2, 16384, 14336, 4096),
    "qwen3_30b_gate_up": (128, 8, 8192, 2048, 2 * 768),
    "qwen3_30b_down": (128, 8, 8192, 768, 2048),
}
BLOCKS = {
    "qwen3_30b": dict(model="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                      num_experts=128, num_experts_per_tok=8, tokens=8192),
    "mixtral": dict(model="mixtral", hidden_size=4096, intermediate_size=14336,
                    num_local_experts=8, num_experts_per_tok=2, tokens=8192),
}


def routing_ids(tokens, top_k, experts, skewed, gen):
    """(tokens, top_k) expert ids: balanced (uniform, without replacement per token) or skewed
    (a quarter of the experts empty, expert 0 with 4x the mean count)."""
    if not skewed:
        return torch.rand(tokens, experts, generator=gen).argsort(1)[:, :top_k]
    live = list(range(experts - experts // 4))
    mean = tokens * top_k / experts
    weights = torch.ones(experts)
    weights[experts - experts // 4:] = 0
    # expert 0 draws 4x the mean, the other live experts share the rest evenly
    rest = (tokens * top_k - 4 * mean) / (len(live) - 1)
    weights[1:len(live)] = rest
    weights[0] = 4 * mean
    ids = torch.multinomial(weights.expand(tokens, experts), top_k, replacement=False,
                            generator=gen)
    return ids


def sorted_rows(padded, routing):
    """The routed rows of a padded-layout tensor in expert order without the padding, and the
    cumulative counts (int32): bf16 ``grouped_mm``'s operand and ``offs``."""
    order = torch.argsort(routing.dest)
    return (padded[routing.dest[order]].contiguous(),
            torch.cumsum(routing.counts, 0).to(torch.int32))


def bf16_grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn


def gemm_case(name, skewed, quick):
    from fp8blk.torch import Float8BlockConfig
    from fp8blk.torch.config import fp8_dtype
    from fp8blk.torch.linear.functional import quantize_buffers
    from fp8blk.torch.moe import grouped_linear, permute, route
    from fp8blk.torch.moe.gemms import (expert_weight_buffers, grouped_mm_rows,
                                        grouped_mm_weights)

    experts, top_k, tokens, k, n = SHAPES[name]
    if quick:
        tokens //= 4
    gen = torch.Generator().manual_seed(0)
    ids = routing_ids(tokens, top_k, experts, skewed, gen).cuda()
    dev = torch.device("cuda")
    hidden = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5)
    w.requires_grad_(True)
    cfg = Float8BlockConfig()
    r = route(ids, experts)
    r.host()
    x_pad = permute(hidden, r)
    dy_pad = torch.zeros(r.rows, n, device=dev, dtype=torch.bfloat16)
    dy_pad[r.dest] = torch.randn(tokens * top_k, n, device=dev, dtype=torch.bfloat16)
    # bf16: the routed rows sorted by expert without padding, offsets = cumulative counts
    xs, offs = sorted_rows(x_pad, r)
    dys, _ = sorted_rows(dy_pad, r)
    gmm = bf16_grouped_mm()
    wd = w.detach()
    wt = wd.transpose(-2, -1)
    g = fp8_dtype(cfg.grad.fmt)
    a = fp8_dtype(cfg.activation.fmt)
    qx = quantize_buffers(x_pad, cfg.activation, True, True)

    def fp8_fwd():
        grouped_linear(x_pad, w, r, cfg)

    def fp8_dgrad():
        qdy = quantize_buffers(dy_pad, cfg.grad, True, False)
        wtd, wts = expert_weight_buffers(wd, cfg.weight, False, False)
        grouped_mm_rows(qdy[0].view(g), qdy[1], wtd, wts, r, torch.bfloat16)

    def fp8_wgrad():
        qdy = quantize_buffers(dy_pad, cfg.grad, False, True)
        grouped_mm_weights(qdy[2].view(g), qdy[3], qx[2].view(a), qx[3], r, torch.bfloat16)

    fns = {"bf16_fwd": lambda: gmm(xs, wt, offs=offs),
           "bf16_dgrad": lambda: gmm(dys, wd, offs=offs),
           "bf16_wgrad": lambda: gmm(dys.t(), xs, offs=offs),
           "fp8blk_fwd": fp8_fwd, "fp8blk_dgrad": fp8_dgrad, "fp8blk_wgrad": fp8_wgrad}
    host = {}
    ms = interleaved_ms(fns, inner=5, repeats=5, warmup=2, host_out=host)
    flop = 2.0 * tokens * top_k * k * n
    rows = []
    for gemm in ("fwd", "dgrad", "wgrad"):
        b, f = ms[f"bf16_{gemm}"], ms[f"fp8blk_{gemm}"]
        rows.append(dict(shape=name, routing="skewed" if skewed else "balanced", gemm=gemm,
                         experts=experts, top_k=top_k, tokens=tokens, k=k, n=n,
                         bf16_ms=round(b, 4), fp8blk_ms=round(f, 4),
                         bf16_tflops=round(flop / b / 1e9, 1),
                         fp8blk_tflops=round(flop / f / 1e9, 1), ratio=round(b / f, 3),
                         bf16_host_us=round(host[f"bf16_{gemm}"], 1),
                         fp8blk_host_us=round(host[f"fp8blk_{gemm}"], 1)))
    return rows


def build_block(name, variant, quick=False):
    """(model, block, step) for MoE block `name` of BLOCKS: the one-layer model it lives in
    (bf16 on the GPU, the experts converted for ``variant`` "fp8blk"), the block, and one
    forward+backward of it on fixed inputs that sets the parameters' gradients to None after
    (``zero_grad(set_to_none=True)``, as a training step)."""
    import transformers

    from fp8blk.torch.moe import convert_experts

    spec = dict(BLOCKS[name])
    model, tokens = spec.pop("model"), spec.pop("tokens")
    if quick:
        tokens //= 4
    cfg = transformers.AutoConfig.for_model(model, num_hidden_layers=1, num_attention_heads=16,
                                            num_key_value_heads=4, vocab_size=1024, **spec)
    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16)
    block = full.model.layers[0].mlp
    if variant == "fp8blk":
        convert_experts(full)
    x = torch.randn(1, tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn_like(x)
    params = list(block.parameters())

    def step(fn=block):
        y = fn(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(g)
        for p in params:
            p.grad = None
    return full, block, step


def block_case(name, quick):
    out = {}
    tokens = BLOCKS[name]["tokens"] // (4 if quick else 1)
    for variant in ("bf16", "fp8blk"):
        full, block, step = build_block(name, variant, quick)
        host = {}
        out[variant] = interleaved_ms({variant: step}, inner=3, repeats=5, warmup=2,
                                      host_out=host)[variant], host[variant]
        step = full = block = None
        gc.collect()
        torch.cuda.empty_cache()
    (b, bh), (f, fh) = out["bf16"], out["fp8blk"]
    return dict(block=name, tokens=tokens, bf16_ms=round(b, 3), fp8blk_ms=round(f, 3),
                ratio=round(b / f, 3), bf16_host_us=round(bh, 1), fp8blk_host_us=round(fh, 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--section", default="default")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--blocks", default=",".join(BLOCKS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_moe needs a CUDA GPU")
    gemms, blocks = [], []
    for name in [s for s in args.shapes.split(",") if s]:
        for skewed in (False, True):
            rows = gemm_case(name, skewed, args.quick)
            gc.collect()
            torch.cuda.empty_cache()
            for row in rows:
                print(f"{row['shape']:20s} {row['routing']:8s} {row['gemm']:5s} bf16 "
                      f"{row['bf16_tflops']:7.1f} TF/s  fp8blk {row['fp8blk_tflops']:7.1f} "
                      f"TF/s  x{row['ratio']:.2f}  host {row['fp8blk_host_us']:.0f} us",
                      flush=True)
            gemms += rows
    for name in [s for s in args.blocks.split(",") if s]:
        row = block_case(name, args.quick)
        print(f"block {row['block']:12s} bf16 {row['bf16_ms']:.2f} ms  fp8blk "
              f"{row['fp8blk_ms']:.2f} ms  x{row['ratio']:.2f}", flush=True)
        blocks.append(row)
    run = dict(machine=torch.cuda.get_device_name(), host=platform.node(),
               date=datetime.date.today().isoformat(),
               command="python3 -m bench.bench_moe " + " ".join(argv or sys.argv[1:]),
               torch=torch.__version__, cases=gemms + [dict(b, kind="block") for b in blocks])
    if args.out:
        write_section(args.out, args.section, run)
    return run


if __name__ == "__main__":
    main()
