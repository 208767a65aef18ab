"""Loss parity on real text: a small Hugging Face Llama trained from scratch on the Python
standard library's own source files as bytes, in bf16 (two seeds), with fp8blk and with
torchao's blockwise FP8 Linear; loss curves (JSON) and a plot (PNG). One results file per
machine holds a section per ``--arch`` (a run replaces its own section, ``{"archs": {arch:
run}}``) and the plot a row per architecture.

    python3 -m bench.loss_parity --out bench/results/loss-parity-h200.json \\
        --plot bench/results/loss-parity-h200.png
    python3 -m bench.loss_parity --device cpu --tiny       # smoke test
    python3 -m bench.loss_parity --replot RESULTS.json --plot FILE.png   # the plot again
    python3 -m bench.loss_parity --arch qwen3_moe --out bench/results/loss-parity-h200.json \\
        --plot bench/results/loss-parity-h200.png       # the mixture-of-experts model

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (not site-packages),
sorted by path and concatenated as bytes (vocab 256, one token per byte); the last 2% of the
bytes are held out for an evaluation loss at the end. Batches: ``--batch`` windows of
``--seq`` + 1 bytes at offsets drawn from a generator seeded with the run's seed.

Model: ``LlamaForCausalLM`` from a config: 4 layers, hidden 512, intermediate 1536, 8 heads,
4 KV heads, vocab 256, SDPA, bf16 parameters, AdamW (lr 1e-3, betas (0.9, 0.95), weight decay
0.1), 30 warm-up steps then cosine to 10%, gradient norm clipped at 1.0; ``--steps`` 300 of
16 x 512 tokens. Runs: ``bf16`` seeds 0 and 1, ``fp8blk`` (``convert_to_float8_block``, every
Linear but lm_head, ``share_quantize=True, norms=True, gated_mlps=True``: the bytes of the
plain conversion)
and ``torchao`` (``Float8BlockwiseLinear.from_float``, where importable) with seed 0, so
fp8blk's and torchao's differences from bf16 seed 0 are the numerics' alone (same init, same
batches).

``--arch qwen3_moe``: ``Qwen3MoeForCausalLM`` instead, 4 layers, hidden 512, 8 experts of
intermediate 256, top-2, the router's load-balancing loss on (``output_router_logits``,
coefficient 0.01, part of the loss), the same heads and training; runs ``bf16`` (transformers'
``grouped_mm`` experts) seeds 0 and 1 and ``fp8blk`` (``convert_to_float8_block(...,
experts=True)``: the experts, the attention projections, the norms) and ``fp8blk_ep``: the
same made expert-parallel on one rank with the FP8 dispatch (``expert_parallel``, a
one-process group), whose only difference from ``fp8blk`` is the weight gradients' 128x1
operands made from the FP8 rows (docs/torch.md, "Expert parallelism"). Each run also reports the experts' load on the
held-out batch (routed rows per expert, per layer) and the summary the largest difference of
an expert's share of the rows from bf16 seed 0's, beside the two bf16 seeds' own.

The bound: S(run) is a run's loss smoothed by a moving average over ``--window`` (20) steps;
``bound`` = max over the last ``--last`` (50) steps of |S(bf16 seed 0) - S(bf16 seed 1)|, the
spread two bf16 runs that differ only in seed show. A run's ``final`` loss is the mean of its
raw losses over the last ``--last`` steps; the run is within the bound when |final(run) -
final(bf16 seed 0)| <= bound.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import sys
import sysconfig
import time

import torch

from bench import bench_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = (("bf16", 0), ("bf16", 1), ("fp8blk", 0), ("torchao", 0))
MOE_RUNS = (("bf16", 0), ("bf16", 1), ("fp8blk", 0), ("fp8blk_ep", 0))


def corpus_bytes(limit=None):
    """The standard library's ``*.py`` sources concatenated (uint8 tensor), and file count."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and "dist-packages" not in p)
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if limit and total >= limit:
            break
    blob = b"".join(chunks)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), len(chunks)


def moe_model_for(variant, tiny, device, seed):
    import transformers

    from fp8blk.torch import convert_to_float8_block

    widths = (dict(hidden_size=128, moe_intermediate_size=128, num_experts=4,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   num_hidden_layers=2) if tiny else
              dict(hidden_size=512, moe_intermediate_size=256, num_experts=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                   num_hidden_layers=4))
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, max_position_embeddings=1024,
                                      tie_word_embeddings=False, num_experts_per_tok=2,
                                      output_router_logits=True, router_aux_loss_coef=0.01,
                                      **widths)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16).to(device)
    if variant in ("fp8blk", "fp8blk_ep"):
        convert_to_float8_block(model, module_filter_fn=lambda m, fqn: fqn != "lm_head",
                                experts=True)
        if variant == "fp8blk_ep":
            from fp8blk.torch.moe import expert_parallel
            expert_parallel(model, _one_rank_group(device), fp8_dispatch=True)
    elif variant != "bf16":
        raise RuntimeError(f"--arch qwen3_moe runs bf16, fp8blk and fp8blk_ep, not {variant}")
    return model


def _one_rank_group(device):
    """The default process group of this one process (NCCL on CUDA, gloo on the CPU), made on
    first use: the expert-parallel run's communicator."""
    import socket

    import torch.distributed as dist
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                **extra)
    return None


def expert_load(model, batch):
    """Routed rows per expert of every MoE layer for one batch: [[count, ...], ...]."""
    from fp8blk.torch.moe import route

    loads, hooks = [], []
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, "experts"):
            continue

        def keep(module, inputs, out, n=block.experts.num_experts):
            loads.append(route(out[-1], n).counts.tolist())
        hooks.append(block.gate.register_forward_hook(keep))
    with torch.no_grad():
        model(input_ids=batch)
    for h in hooks:
        h.remove()
    return loads


def model_for(variant, tiny, device, seed, arch="llama"):
    import transformers

    if arch == "qwen3_moe":
        return moe_model_for(variant, tiny, device, seed)
    widths = (dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                   num_key_value_heads=1, num_hidden_layers=2) if tiny else
              dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                   num_key_value_heads=4, num_hidden_layers=4))
    cfg = transformers.LlamaConfig(vocab_size=256, max_position_embeddings=1024,
                                   tie_word_embeddings=False, **widths)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return bench_model.convert(model, "fp8blk_opt" if variant == "fp8blk" else variant)


def lr_at(step, steps, peak=1e-3, warmup=30):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(variant, seed, data, args, device):
    """Per-step losses (floats), the held-out loss of one run and (MoE) the experts' load."""
    model = model_for(variant, args.tiny, device, seed, args.arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda", foreach=device.type != "cuda")
    split = int(len(data) * 0.98)
    train_data, held = data[:split], data[split:]
    gen = torch.Generator().manual_seed(seed)
    span = args.seq + 1
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, len(train_data) - span, (args.batch,), generator=gen)
        batch = torch.stack([train_data[s:s + span] for s in starts.tolist()]).to(
            device, torch.long)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    losses = [float(v) for v in torch.stack(losses).cpu()]
    with torch.no_grad():
        n = min(len(held) // span, 8) or 1
        batch = torch.stack([held[i * span:(i + 1) * span] for i in range(n)]).to(
            device, torch.long)
        held_loss = float(model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss)
    load = expert_load(model, batch[:, :-1]) if args.arch == "qwen3_moe" else None
    return losses, held_loss, load


def smooth(xs, window):
    out, acc = [], 0.0
    for i, v in enumerate(xs):
        acc += v
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def summarize(runs, window, last):
    s = {name: smooth(r["losses"], window) for name, r in runs.items()}
    ref, other = "bf16_seed0", "bf16_seed1"
    bound = max(abs(a - b) for a, b in zip(s[ref][-last:], s[other][-last:]))
    out = {"bound": bound, "window": window, "last": last, "runs": {}}
    final_ref = sum(runs[ref]["losses"][-last:]) / last
    for name, r in runs.items():
        final = sum(r["losses"][-last:]) / last
        out["runs"][name] = {"final": final, "held_out": r["held_out"],
                             "diff_vs_bf16_seed0": final - final_ref,
                             "within_bound": abs(final - final_ref) <= bound}
        if "expert_load" in r and "expert_load" in runs[ref]:
            out["runs"][name]["max_share_diff_vs_bf16_seed0"] = max(
                abs(a / sum(la) - b / sum(lb))
                for la, lb in zip(r["expert_load"], runs[ref]["expert_load"])
                for a, b in zip(la, lb))
    return out


def plot(panels, path):
    """One row per ``(runs, summary, window, title)`` panel: the smoothed curves and their
    last third."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.5 * len(panels)), squeeze=False)
    for (ax, ax2), (runs, summary, window, title) in zip(axes, panels):
        for name, r in runs.items():
            s = smooth(r["losses"], window)
            ax.plot(s, label=f"{name} (final {summary['runs'][name]['final']:.4f})", lw=1.2)
            tail = len(s) // 3
            ax2.plot(range(len(s) - tail, len(s)), s[-tail:], label=name, lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (moving average, {window} steps)")
        ax.set_title(title)
        ax.legend()
        ax2.set_xlabel("step")
        ax2.set_title(f"last third; bound (bf16 seed spread) {summary['bound']:.4f}")
        ax2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def sections(path):
    """{arch: result} of a results file (a file of one run without sections is its arch's)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if "archs" in data:
        return data["archs"]
    return {data.get("settings", {}).get("arch", "llama"): data}


def plot_file(archs, path):
    """The plot of every architecture of a results file that has a summary."""
    panels = [(r["runs"], r["summary"], r["settings"]["window"],
               _title(arch, r["settings"]["tiny"]))
              for arch, r in archs.items() if r.get("summary")]
    return bool(panels) and plot(panels, path)


def _title(arch, tiny):
    model = "Qwen3-MoE 8 experts top-2" if arch == "qwen3_moe" else "Llama"
    return f"{model} {'2x128' if tiny else '4x512'}, stdlib bytes, from scratch"


def _write(args, argv, device, data, nfiles, t0, runs, errors, quiet):
    """The results so far (JSON to ``--out``, the plot to ``--plot``); the summary printed
    unless ``quiet``."""
    summary = summarize(runs, args.window, args.last) \
        if {"bf16_seed0", "bf16_seed1"} <= set(runs) else None
    if summary and not quiet:
        print(f"bound (max |S(bf16 seed 0) - S(bf16 seed 1)| over the last {args.last} steps, "
              f"S = {args.window}-step moving average): {summary['bound']:.4f}")
        for name, r in summary["runs"].items():
            print(f"  {name:12} final {r['final']:.4f}  vs bf16 seed 0 "
                  f"{r['diff_vs_bf16_seed0']:+.4f}  held-out {r['held_out']:.4f}  "
                  f"{'within' if r['within_bound'] else 'OUTSIDE'} the bound" +
                  (f"  experts' share max diff {r['max_share_diff_vs_bf16_seed0']:.4f}"
                   if "max_share_diff_vs_bf16_seed0" in r else ""))
    result = {"machine": {"host": platform.node(), "torch": torch.__version__,
                          "device": str(device),
                          "gpu": torch.cuda.get_device_name() if device.type == "cuda"
                          else None},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([sys.executable] + (sys.argv if argv is None
                                                      else ["bench/loss_parity.py", *argv])),
              "corpus": {"files": nfiles, "bytes": len(data),
                         "stdlib": sysconfig.get_paths()["stdlib"]},
              "settings": {k: getattr(args, k) for k in ("steps", "batch", "seq", "window",
                                                         "last", "tiny", "arch")},
              "wall_s": time.perf_counter() - t0, "summary": summary, "errors": errors,
              "runs": runs}
    # one file per machine: this architecture's section replaces its own, the others stay
    archs = sections(args.out)
    archs[args.arch] = result
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"archs": archs}, f, indent=1)
        if not quiet:
            print("wrote", args.out)
    if args.plot and summary and plot_file(archs, args.plot) and not quiet:
        print("wrote", args.plot)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="default 300 (--tiny: 20)")
    parser.add_argument("--batch", type=int, default=None, help="default 16 (--tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 512 (--tiny: 64)")
    parser.add_argument("--window", type=int, default=None, help="default 20 (--tiny: 5)")
    parser.add_argument("--last", type=int, default=None, help="default 50 (--tiny: 5)")
    parser.add_argument("--arch", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--runs", default=None,
                        help="variant:seed,... (default: " + ",".join(
                            f"{v}:{s}" for v, s in RUNS) + "; qwen3_moe: " + ",".join(
                            f"{v}:{s}" for v, s in MOE_RUNS) + ")")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="only draw --plot from a results file this script wrote")
    args = parser.parse_args(argv)
    if args.replot:
        archs = sections(args.replot)
        if args.plot and plot_file(archs, args.plot):
            print("wrote", args.plot)
        return archs
    t = args.tiny
    args.runs = args.runs or ",".join(f"{v}:{s}" for v, s in (
        RUNS if args.arch == "llama" else MOE_RUNS))
    args.steps = args.steps or (20 if t else 300)
    args.batch = args.batch or (2 if t else 16)
    args.seq = args.seq or (64 if t else 512)
    args.window = args.window or (5 if t else 20)
    args.last = args.last or (5 if t else 50)
    device = torch.device(args.device)
    data, nfiles = corpus_bytes(limit=2_000_000 if t else None)
    print(f"corpus: {nfiles} files, {len(data)} bytes from {sysconfig.get_paths()['stdlib']}")
    runs, errors = {}, {}
    t0 = time.perf_counter()
    result = None
    for item in args.runs.split(","):
        variant, seed = item.split(":")
        name = f"{variant}_seed{seed}"
        t1 = time.perf_counter()
        try:
            losses, held, load = train(variant, int(seed), data, args, device)
        except RuntimeError as err:
            errors[name] = str(err)
            print(f"{name}: {err}")
            continue
        runs[name] = {"variant": variant, "seed": int(seed), "losses": losses,
                      "held_out": held, "wall_s": time.perf_counter() - t1}
        if load is not None:
            runs[name]["expert_load"] = load
        print(f"{name}: final-{args.last} mean {sum(losses[-args.last:]) / args.last:.4f}, "
              f"held-out {held:.4f} ({runs[name]['wall_s']:.1f} s)", flush=True)
        # written after every run, so that a run stopped by a time limit keeps the ones done
        result = _write(args, argv, device, data, nfiles, t0, runs, errors, quiet=True)
    result = _write(args, argv, device, data, nfiles, t0, runs, errors, quiet=False)
    return result


if __name__ == "__main__":
    main()
