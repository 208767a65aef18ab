"""Model benchmark: a Hugging Face ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` built from a
config, trained in bf16, with fp8blk and with torchao's blockwise FP8 Linear, eager and
``torch.compile`` (``--modes``: ``compiled`` per decoder layer or, ``--compile-scope model``,
the whole model; ``compiled_ro`` the same with ``mode="reduce-overhead"``: CUDA graphs), on one
GPU.

    python3 -m bench.bench_model [--arch llama,qwen3] [--layers 8] [--tokens 8192]
        [--variants bf16,fp8blk,fp8blk_opt,torchao] [--modes eager,compiled] [--breakdown]
        [--memory-snapshot DIR] [--out bench/results/model-h200.json]
    python3 -m bench.bench_model --device cpu --tiny          # smoke test (CPU, seconds)

Models (``transformers`` is an optional extra: ``pip install 'fp8blk[transformers]'``), built
in bf16 on the device from a config, SDPA attention, no pretrained weights:

* llama: Llama-3-8B widths: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab
  32768 (a smaller vocab than Llama-3's 128256, so that the lm_head, kept in bf16, does not
  dominate 8 layers); llama_1b: Llama-3.2-1B widths: hidden 2048, intermediate 8192, 32
  heads, 8 KV heads, vocab 32768, 16 layers by default;
* qwen3: Qwen3-8B widths: hidden 4096, intermediate 12288, 32 heads, 8 KV heads, head_dim 128,
  per-head q/k RMSNorms, vocab 32768;
* qwen3_moe: Qwen3-30B-A3B widths: hidden 2048, 128 experts of 768, top-8, 32 heads, 4 KV
  heads, head_dim 128, vocab 32768; mixtral: Mixtral-8x7B widths: hidden 4096, 8 experts of
  14336, top-2, 32 heads, 8 KV heads, vocab 32768 (``--tiny``: 8 / 4 experts of 128 / 256).

``--tiny``: hidden 256, intermediate 512, 4 heads, 2 KV heads, vocab 512, 2 layers, 2 x 128
tokens.

Variants (every ``nn.Linear`` but ``lm_head`` converted):

* ``bf16``: the model as built; ``bf16_norm``: its RMSNorms swapped for
  ``fp8blk.torch.norm.Float8BlockRMSNorm`` (what the norm alone buys, in bf16);
  ``bf16_opt``: also its MLPs for ``fp8blk.torch.mlp.Float8BlockGatedMLP``;
* ``fp8blk``: ``convert_to_float8_block`` with the default config and every option off (the
  Linear swap alone; the converter's default, all four on, is ``fp8blk_opt``, and with a MoE
  model's experts ``fp8blk_experts``);
* ``fp8blk_share``: ``share_quantize=True`` (quantize once per activation,
  ``fp8blk.torch.linear.sharing``); ``fp8blk_norm``: ``norms=True``; ``fp8blk_mlp``:
  ``gated_mlps=True``; ``fp8blk_norm_mlp``: both; ``fp8blk_nokeep``: all three;
  ``fp8blk_opt``: these and ``keep_inputs=True`` (layers keep their input where it is kept
  anyway: ``Float8BlockLinear.keep_input``) -- the bytes of ``fp8blk_norm_mlp``; of
  ``fp8blk`` but for the norms' gradients, which differ by rounding: ``fp8blk.torch.norm``;
* ``fp8blk_experts``: the converter's default, its experts included (a MoE model's experts
  through ``fp8blk.torch.moe``; the other fp8blk variants pass ``experts=False`` and leave
  them in bf16, transformers' ``grouped_mm``); ``fp8blk_experts_recompute``: the same with
  ``fp8blk.torch.moe.grouped.COMPILED_RECOMPUTE`` (compiled, the experts after their first
  projection in a checkpointed region: what eager mode keeps); ``fp8blk_experts_nokeep``:
  the default with the experts' first projection keeping the permuted rows' columnwise FP8
  copy instead of the tokens (``convert_experts(..., keep_input=False)``: what the keep
  costs and saves);
* ``torchao``: ``torchao.prototype.blockwise_fp8_training.linear.Float8BlockwiseLinear``
  (torchao 0.18.0 wheel, ``torchao/prototype/blockwise_fp8_training/linear.py``:
  ``from_float(mod)`` asserts no bias and in/out features multiples of 128, the constructor
  SM90; the same module holds ``Float8BlockwiseLinearConfig`` for ``quantize_``), where
  importable.

A step: ``model(input_ids=ids, labels=ids).loss``, backward, ``AdamW.step`` (fused on CUDA),
``zero_grad(set_to_none=True)``; ids (batch, seq) random tokens, ``--tokens`` = batch x seq
(``--seq`` 4096). ``compiled``: each decoder layer compiled in place (``layer.compile()``,
torchtitan's per-block scheme; one compiled graph serves all layers), or the whole model with
``--compile-scope model``.

Per case:

* ``step_ms``: median of ``--steps`` steps, each between two CUDA events, back to back, after
  ``--warmup`` steps; ``tokens_per_s`` from it;
* ``peak_bytes``: ``torch.cuda.max_memory_allocated`` over the timed steps (reset after the
  warm-up, when the optimizer state exists), less what was allocated before the case's model
  was built (``start_bytes``, 0 unless an earlier case leaked);
* ``state_bytes``: the parameters, their gradients (as many bytes as the parameters) and the
  optimizer's state: all three are alive at the optimizer step, so no variant's peak goes
  below it; ``peak_floor_vs_bf16``: it over bf16's ``peak_bytes``, the lowest
  ``peak_bytes_vs_bf16`` any variant could show;
* ``saved_bytes``: the bytes autograd keeps between the passes, counted in
  ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's storage once (parameters
  excluded: they are held anyway), for one forward pass; None where the hooks cannot run.
  Compiled, the hooks see what each compiled graph keeps: AOTAutograd's forward graph
  returns the tensors its backward graph reads and its autograd function saves them with
  ``save_for_backward``, which the hooks see (a tensor that lives only inside one graph is
  not kept between the passes); measured after the warm-up, so on the graphs that were
  timed; ``held_bytes``: ``torch.cuda.memory_allocated`` after
  the forward pass minus before it (saved tensors, the loss's logits and whatever else is
  alive);
* ``host_ms``: the host's wall time to issue one step while the GPU runs a sleep kernel
  queued before it (longer than the step's issue time), so the GPU queue is not the bound:
  the median over 3 steps (``host_ms_waited_for_gpu``: the step waited for the GPU, so
  ``host_ms`` is not the host's cost); ``cpu_ms``: process CPU time per timed step (all
  threads: autograd runs the backward pass's host work on its device thread);
* ``breakdown`` (``--breakdown``): GPU kernel time per step from ``torch.profiler`` over 2
  steps, by kernel name: GEMMs, fp8blk's kernels (Numba's ``cudapy`` names), other quantize
  kernels (torchao's Triton), attention, optimizer, the rest.

``--memory-snapshot DIR``: for the first eager case of bf16 and of each fp8blk variant, one
step after the warm-up recorded with ``torch.cuda.memory._record_memory_history`` and dumped
to ``DIR/<arch>-<variant>.pickle`` (open in https://pytorch.org/memory_viz), and a summary
printed and stored in the results: the peak within the step and the allocations alive at it,
by the innermost stack frame outside torch (``python3 -m bench.bench_model --summarize
FILE.pickle`` prints it again).

Prints a table and writes one JSON file (machine, date, command, per-case figures);
``--combine A.json B.json --out FILE`` merges the files of separate runs (one per ``--arch``,
say) into one.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import pickle
import platform
import re
import statistics
import sys
import time

import torch

from bench.bench_linear import sleep_ms
from fp8blk.torch import convert_to_float8_block, release_scratch
from fp8blk.torch.mlp import convert_gated_mlps
from fp8blk.torch.norm import convert_norms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WIDTHS = {
    "llama": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32768),
    "llama_1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32768),
    "qwen3": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=32768),
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, vocab_size=32768),
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                    num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=32768),
}
LAYERS = {"llama_1b": 16}      # an arch's default --layers (others: 8)
_TINY_MOE = {"qwen3_moe": dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                               head_dim=64),
             "mixtral": dict(intermediate_size=256, num_local_experts=4,
                             num_experts_per_tok=2)}
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
VARIANTS = ("bf16", "bf16_norm", "bf16_opt", "fp8blk", "fp8blk_share", "fp8blk_norm",
            "fp8blk_mlp", "fp8blk_norm_mlp", "fp8blk_nokeep", "fp8blk_opt", "fp8blk_experts",
            "fp8blk_experts_recompute", "fp8blk_experts_nokeep", "torchao")
DEFAULT_VARIANTS = ("bf16", "fp8blk", "fp8blk_opt", "torchao")
# mode -> torch.compile's mode (eager: not compiled; compiled_ro: "reduce-overhead", CUDA
# graphs over each compiled region)
MODES = {"eager": None, "compiled": None, "compiled_ro": "reduce-overhead"}


def model_config(arch, layers, seq, tiny=False):
    """The transformers config of `arch` ("llama", "qwen3", "qwen3_moe" or "mixtral") with
    `layers` decoder layers."""
    import transformers

    widths = dict(TINY, **({"head_dim": 64} if arch == "qwen3" else {}),
                  **_TINY_MOE.get(arch, {})) if tiny else WIDTHS[arch]
    cls = {"llama": transformers.LlamaConfig, "llama_1b": transformers.LlamaConfig,
           "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[arch]
    cfg = cls(num_hidden_layers=layers, max_position_embeddings=max(seq, 128),
              tie_word_embeddings=False, **widths)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(arch, variant, layers, seq, device, tiny=False, seed=0):
    """A freshly initialized bf16 model of `arch` on `device`, converted as `variant` says
    (module docstring). Raises RuntimeError naming why a variant cannot be built."""
    import transformers

    cfg = model_config(arch, layers, seq, tiny)
    cls = {"llama": transformers.LlamaForCausalLM, "llama_1b": transformers.LlamaForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[arch]
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    convert(model, variant)
    return model


def not_lm_head(module, fqn):
    return not fqn.endswith("lm_head")


def convert(model, variant):
    """Convert `model` in place as `variant` says."""
    if variant == "bf16":
        return model
    if variant == "bf16_norm":
        convert_norms(model)
        return model
    if variant == "bf16_opt":
        convert_norms(model)
        convert_gated_mlps(model)
        return model
    if variant == "torchao":
        try:
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
        except Exception as err:  # noqa: BLE001  (reported, the other variants still run)
            raise RuntimeError(f"torchao not importable: {type(err).__name__}: {err}") from None
        for fqn, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                full = f"{fqn}.{name}" if fqn else name
                if type(child) is torch.nn.Linear and not_lm_head(child, full):
                    try:
                        setattr(parent, name, Float8BlockwiseLinear.from_float(child))
                    except Exception as err:  # noqa: BLE001
                        raise RuntimeError(f"torchao: {full}: {type(err).__name__}: "
                                           f"{err}") from None
        return model
    if variant in ("fp8blk_experts", "fp8blk_experts_recompute", "fp8blk_experts_nokeep"):
        from fp8blk.torch.moe import convert_experts, grouped
        # process-wide: every variant sets it when built (the runs are one after another)
        grouped.COMPILED_RECOMPUTE = variant == "fp8blk_experts_recompute"
        model = convert_to_float8_block(model, module_filter_fn=not_lm_head)
        if variant == "fp8blk_experts_nokeep":
            convert_experts(model, keep_input=False)    # the same config: marks them again
        return model
    on = {"fp8blk": (), "fp8blk_share": ("share_quantize",), "fp8blk_norm": ("norms",),
          "fp8blk_mlp": ("gated_mlps",), "fp8blk_norm_mlp": ("norms", "gated_mlps"),
          "fp8blk_nokeep": ("share_quantize", "norms", "gated_mlps"),
          "fp8blk_opt": ("share_quantize", "norms", "gated_mlps", "keep_inputs")}[variant]
    # every option named: the converter's defaults are all four on
    opts = {o: o in on for o in ("share_quantize", "norms", "gated_mlps", "keep_inputs")}
    return convert_to_float8_block(model, module_filter_fn=not_lm_head, experts=False, **opts)


def compile_model(model, scope="layers", mode=None):
    """Compile `model` in place: each decoder layer (``scope="layers"``) or the whole model,
    with torch.compile's `mode` (None: the default; "reduce-overhead": CUDA graphs)."""
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    if scope == "model":
        model.compile(mode=mode)
    else:
        for layer in model.model.layers:
            layer.compile(mode=mode)
    return model


def make_step(model, ids, lr=1e-4, graphs=False):
    """The training step as a callable, and its optimizer. ``graphs``: the model runs CUDA
    graphs of torch.compile's "reduce-overhead" mode, told where each step begins."""
    fused = ids.is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused, foreach=not fused)

    def step(mark=None):
        """One step; ``mark(phase)`` is called after the forward and backward passes."""
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = model(input_ids=ids, labels=ids).loss
        if mark is not None:
            mark("forward")
        loss.backward()
        if mark is not None:
            mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, opt


def saved_bytes(run_forward, exclude=()):
    """Bytes autograd saves for the backward pass during ``run_forward()`` (its return value
    is returned too): each saved tensor's storage counted once, the storages of the tensors in
    `exclude` (the parameters) not at all."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in skip and ptr not in seen:
                seen[ptr] = st.nbytes()
        except (RuntimeError, NotImplementedError):     # a tensor without storage (fake)
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    return sum(seen.values()), out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, steps, device):
    """Per-step ms: CUDA events around each step back to back (CUDA), wall times (CPU); and
    the process CPU time per step."""
    _sync(device)
    cpu0 = time.process_time()
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            step()
            events[i + 1].record()
        events[-1].synchronize()
        ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    else:
        ms = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            ms.append((time.perf_counter() - t0) * 1e3)
    cpu = (time.process_time() - cpu0) * 1e3 / steps
    return ms, cpu




def host_ms(step, device, sleep, repeats=3):
    """Median host wall ms to issue one step with the GPU kept busy by a sleep queued first
    (CUDA); on the CPU, None (the host is the device)."""
    if device.type != "cuda":
        return None
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        sleep_ms(sleep)
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


_AREAS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("fp8blk_kernels", re.compile(r"cudapy|fp8blk|^kernel\b")),
    ("quantize_other", re.compile(r"quant|fp8_blockwise|cast_to_fp8", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|matmul|cublas|splitk|wgmma", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
)


def classify(kernel_name):
    for area, pattern in _AREAS:
        if pattern.search(kernel_name):
            return area
    return "other"


def breakdown(step, device, steps=2):
    """{area: GPU ms per step} from a torch.profiler trace of `steps` steps (CUDA only), and
    the 8 kernels with the most time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    areas = collections.Counter()
    kernels = collections.Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            areas[classify(e.name)] += us / 1e3 / steps
            kernels[e.name] += us / 1e3 / steps
    return {"areas_ms": dict(areas), "total_ms": sum(areas.values()),
            "top_kernels_ms": {k[:120]: v for k, v in kernels.most_common(8)}}


# -- memory snapshots ---------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)


def _site(frames, depth=2):
    """The `depth` innermost frames outside torch's own files, as "file:line function <-
    ..."; frames are innermost first."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        if name and not name.startswith(_TORCH_DIR) and "<" not in name:
            rel = os.path.relpath(name, ROOT) if name.startswith(ROOT) else \
                re.sub(r".*/site-packages/", "", name)
            out.append(f"{rel}:{f.get('line')} {f.get('name')}")
            if len(out) == depth:
                break
    if out:
        return " <- ".join(out)
    return "(torch internals)" if frames else "(no Python frame)"


def _phase_mark(phase):
    """A tiny allocation whose stack names the phase that ends here (found by
    :func:`summarize_snapshot`), kept until the snapshot is dumped."""
    _marks.append((phase, torch.empty(1, device="cuda")))


_marks = []


def summarize_snapshot(path, top=15, baseline=None):
    """The peak of allocated bytes within a recorded snapshot's trace, the phase it falls in
    (forward / backward / optimizer, from :func:`_phase_mark`'s allocations) and the
    allocations alive at it that were made within the trace: grouped by :func:`_site`, and
    the largest ones. `baseline`: bytes allocated when recording began (parameters, optimizer
    state), stored beside the snapshot by :func:`record_snapshot`."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    if baseline is None:
        meta = path + ".json"
        baseline = json.load(open(meta))["baseline_bytes"] if os.path.exists(meta) else 0
    traces = [t for t in snap.get("device_traces", []) if t]
    trace = traces[0] if traces else []
    total, peak, peak_i = 0, 0, -1
    bounds = []                      # (trace index, phase that ends there)
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            total += ev["size"]
            phase = next((f.get("name") for f in ev.get("frames", [])
                          if f.get("name") == "_phase_mark"), None)
            if phase is not None:
                bounds.append(i)
        elif ev["action"] == "free_completed":
            total -= ev["size"]
        if total > peak:
            peak, peak_i = total, i
    names = ("forward", "backward", "optimizer")
    phase = names[sum(1 for b in bounds if b < peak_i)] if bounds else None
    alive = {}
    for i, ev in enumerate(trace[:peak_i + 1]):
        if ev["action"] == "alloc":
            alive[ev["addr"]] = (i, ev)
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)
    groups = collections.Counter()
    counts = collections.Counter()
    largest = []
    for i, ev in alive.values():
        site = _site(ev.get("frames", []))
        if site.startswith("(") and bounds:      # no frame to name: say when it was made
            site += f" made in {names[sum(1 for b in bounds if b < i)]}"
        groups[site] += ev["size"]
        counts[site] += 1
        largest.append((ev["size"], site))
    largest.sort(reverse=True)
    return {"baseline_bytes": baseline, "peak_above_baseline_bytes": peak,
            "peak_bytes": baseline + peak, "peak_phase": phase, "events": len(trace),
            "alive_at_peak_bytes": sum(groups.values()),
            "top": [{"site": s, "bytes": b, "count": counts[s]}
                    for s, b in groups.most_common(top)],
            "largest": [{"site": s, "bytes": b} for b, s in largest[:top]]}


def print_summary(name, s):
    gib, mib = 2 ** 30, 2 ** 20
    print(f"memory snapshot {name}: peak {s['peak_bytes'] / gib:.2f} GiB = baseline "
          f"{s['baseline_bytes'] / gib:.2f} (parameters, optimizer state) + "
          f"{s['peak_above_baseline_bytes'] / gib:.2f} made within the step, in its "
          f"{s['peak_phase']} phase ({s['events']} events). Alive at the peak, by site "
          f"(no Python frame: autograd's C++ backward):")
    for t in s["top"]:
        print(f"  {t['bytes'] / gib:8.3f} GiB  {t['count']:5d}x  {t['site']}")
    print("  largest: " + ", ".join(f"{t['bytes'] / mib:.0f} MiB {t['site'].split(' <- ')[0]}"
                                    for t in s["largest"][:8]))


def print_difference(name_a, name_b, a, b, top=20):
    """What is alive at the peak of snapshot b and not of a, by site (largest differences)."""
    gib = 2 ** 30
    sa = {t["site"]: t["bytes"] for t in a["top"]}
    sb = {t["site"]: t["bytes"] for t in b["top"]}
    diff = sorted(((sb.get(k, 0) - sa.get(k, 0), k) for k in set(sa) | set(sb)),
                  key=lambda d: -abs(d[0]))
    print(f"alive at the peak, {name_b} minus {name_a}: peak "
          f"{(b['peak_bytes'] - a['peak_bytes']) / gib:+.3f} GiB, baseline "
          f"{(b['baseline_bytes'] - a['baseline_bytes']) / gib:+.3f} GiB")
    for d, k in diff[:top]:
        print(f"  {d / gib:+8.3f} GiB  {k}")


def record_snapshot(step, path):
    """One step (``step(mark)``) recorded with the allocator's history, dumped to `path`
    (CUDA)."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step(_phase_mark)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        _marks.clear()
    with open(path + ".json", "w") as f:
        json.dump({"baseline_bytes": baseline}, f)
    return summarize_snapshot(path, baseline=baseline)


# -- one case -----------------------------------------------------------------------------

def state_bytes(params, opt):
    """Bytes of `params`, of gradients of the same sizes and of `opt`'s state tensors."""
    def nbytes(t):
        return t.numel() * t.element_size()
    return (2 * sum(nbytes(p) for p in params)
            + sum(nbytes(v) for st in opt.state.values() for v in st.values()
                  if torch.is_tensor(v)))


def default_out(device, tiny):
    """Where a run without ``--out`` writes: the committed results file for a full run on the
    GPU; nowhere for a CPU run or a ``--tiny`` smoke run (it must not replace real figures)."""
    if device.type != "cuda" or tiny:
        return None
    return os.path.join(ROOT, "bench", "results", "model-h200.json")


def run_case(arch, variant, mode, args, device):
    layers = args.layers or LAYERS.get(arch, 8)
    case = {"arch": arch, "variant": variant, "mode": mode, "layers": layers,
            "tokens": args.batch * args.seq, "batch": args.batch, "seq": args.seq}
    torch._dynamo.reset()       # compiled code of earlier cases holds on to their modules
    release_scratch()           # and fp8blk's scratch memory is made again: a fresh state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        case["start_bytes"] = base = torch.cuda.memory_allocated()
    try:
        model = build_model(arch, variant, layers, args.seq, device, args.tiny)
    except RuntimeError as err:
        case["error"] = str(err)
        return case
    if mode != "eager":
        compile_model(model, args.compile_scope, MODES[mode])
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device,
                        generator=gen)
    step, opt = make_step(model, ids, graphs=MODES[mode] == "reduce-overhead")
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(device)
    case["warmup_s"] = time.perf_counter() - t0
    params = list(model.parameters())

    def forward():
        if MODES[mode] == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return model(input_ids=ids, labels=ids).loss

    # saved bytes and held bytes between the passes, one forward each (then backward, to free)
    try:
        nbytes, loss = saved_bytes(forward, exclude=params)
        loss.backward()
        case["saved_bytes"] = nbytes
    except Exception as err:  # noqa: BLE001  (compiled graphs may refuse the hooks)
        case["saved_bytes"] = None
        case["saved_bytes_error"] = f"{type(err).__name__}: {err}"[:300]
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = forward()
        torch.cuda.synchronize()
        case["held_bytes"] = torch.cuda.memory_allocated() - before
        loss.backward()
        loss = None
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms, cpu = time_steps(step, args.steps, device)
    case["step_ms_all"] = ms
    case["step_ms"] = statistics.median(ms)
    case["tokens_per_s"] = case["tokens"] / case["step_ms"] * 1e3
    case["cpu_ms"] = cpu
    case["state_bytes"] = state_bytes(params, opt)
    if device.type == "cuda":
        case["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        sleep = 1.5 * case["step_ms"] + 50
        case["host_ms"] = host_ms(step, device, sleep)
        # a host that waited for the GPU within the step would have waited out the sleep
        case["host_ms_waited_for_gpu"] = case["host_ms"] >= 0.9 * sleep
    if args.breakdown and device.type == "cuda":
        case["breakdown"] = breakdown(step, device)
    snap_variants = ("bf16",) + tuple(v for v in VARIANTS if v.startswith("fp8blk"))
    if args.memory_snapshot and mode == "eager" and variant in snap_variants \
            and device.type == "cuda":
        os.makedirs(args.memory_snapshot, exist_ok=True)
        path = os.path.join(args.memory_snapshot, f"{arch}-{variant}.pickle")
        case["memory_snapshot"] = {"path": path, **record_snapshot(step, path)}
        print_summary(f"{arch} {variant}", case["memory_snapshot"])
    del step, opt, model, forward, params
    torch._dynamo.reset()
    return case


def ratios(cases):
    """Each case's tokens/s, peak, saved bytes and peak floor (``state_bytes``) over bf16's
    (and tokens/s over torchao's) of the same arch, mode and layer count."""
    by = {(c["arch"], c["mode"], c.get("layers"), c["variant"]): c for c in cases
          if "error" not in c}
    for c in cases:
        if "error" in c:
            continue
        for ref in ("bf16", "torchao"):
            r = by.get((c["arch"], c["mode"], c.get("layers"), ref))
            if r is None or r is c:
                continue
            c[f"speedup_vs_{ref}"] = c["tokens_per_s"] / r["tokens_per_s"]
            if ref == "bf16":
                for key in ("peak_bytes", "saved_bytes", "held_bytes"):
                    if c.get(key) is not None and r.get(key):
                        c[f"{key}_vs_bf16"] = c[key] / r[key]
        r = by.get((c["arch"], c["mode"], c.get("layers"), "bf16"))
        if r is not None and c.get("state_bytes") and r.get("peak_bytes"):
            c["peak_floor_vs_bf16"] = c["state_bytes"] / r["peak_bytes"]
    return cases


def print_table(cases):
    gib = 2 ** 30
    print(f"{'arch':6} {'mode':8} {'variant':13} {'step ms':>8} {'tok/s':>9} {'xbf16':>6} "
          f"{'xtao':>5} {'peak GiB':>8} {'xbf16':>6} {'floor':>5} {'saved GiB':>9} {'xbf16':>6} "
          f"{'host ms':>7} {'cpu ms':>7}")
    for c in cases:
        if "error" in c:
            print(f"{c['arch']:6} {c['mode']:8} {c['variant']:13} error: {c['error']}")
            continue

        def f(key, scale=1.0, fmt="{:.2f}"):
            v = c.get(key)
            return fmt.format(v / scale) if v is not None else "-"
        print(f"{c['arch']:6} {c['mode']:8} {c['variant']:13} {c['step_ms']:8.1f} "
              f"{c['tokens_per_s']:9.0f} {f('speedup_vs_bf16'):>6} {f('speedup_vs_torchao'):>5} "
              f"{f('peak_bytes', gib):>8} {f('peak_bytes_vs_bf16'):>6} "
              f"{f('peak_floor_vs_bf16'):>5} "
              f"{f('saved_bytes', gib, '{:.3f}'):>9} {f('saved_bytes_vs_bf16'):>6} "
              f"{f('host_ms', 1, '{:.1f}'):>7} {c['cpu_ms']:7.1f}")
        if "breakdown" in c:
            b = c["breakdown"]
            print("    GPU ms per step: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(b["areas_ms"].items(), key=lambda kv: -kv[1]))
                + f" (total {b['total_ms']:.1f})")


def combine(paths, out):
    """One result file from several: the machine of the first, every run's date, command and
    cases (a later file's case replaces an earlier one of the same arch, variant, mode and
    layer count)."""
    runs = [json.load(open(p)) for p in paths]
    cases = {}
    for r in runs:
        for c in r["cases"]:
            for key in [k for k in c if k.startswith("speedup_vs_") or k.endswith("_vs_bf16")]:
                del c[key]
            cases[(c["arch"], c["variant"], c["mode"], c.get("layers"))] = c
    def flat(command):     # a combined file's command is already a list of its runs'
        return ([c for part in command for c in flat(part)] if isinstance(command, list)
                else [command])

    def run_entries(r):    # a combined file brings its runs, a run's file itself
        if "runs" in r and isinstance(r["command"], list):
            return [dict(e, command=" ; ".join(flat(e["command"]))) for e in r["runs"]]
        return [{"date": r["date"], "command": r["command"], "wall_s": r.get("wall_s")}]
    result = {"machine": runs[0]["machine"], "date": runs[-1]["date"],
              "command": [c for r in runs for c in flat(r["command"])],
              "runs": [e for r in runs for e in run_entries(r)],
              "cases": ratios(list(cases.values()))}
    print_table(result["cases"])
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", out)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="llama,qwen3")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--modes", default=None, help="of eager,compiled,compiled_ro (default: "
                        "eager,compiled on CUDA, eager on the CPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="default 8, llama_1b 16 (--tiny: 2)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step, batch x --seq (default 8192; --tiny: 256)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (--tiny: 128)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-scope", choices=("layers", "model"), default="layers")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--memory-snapshot", metavar="DIR", default=None)
    parser.add_argument("--summarize", metavar="PICKLE", nargs="+", default=None,
                        help="print the summary of snapshots written by --memory-snapshot "
                             "(two: also what differs between them, by site)")
    parser.add_argument("--combine", nargs="+", metavar="JSON", default=None,
                        help="merge result files of separate runs (e.g. one per --arch) into "
                             "--out, ratios recomputed; runs nothing")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None,
                        help="JSON path (default bench/results/model-h200.json on CUDA, "
                             "none with --tiny)")
    args = parser.parse_args(argv)
    if args.summarize:
        sums = [summarize_snapshot(p, top=10_000) for p in args.summarize]
        for p, sm in zip(args.summarize, sums):
            print_summary(p, dict(sm, top=sm["top"][:15]))
        if len(sums) == 2:
            print_difference(*args.summarize, *sums)
        return None
    if args.combine:
        return combine(args.combine, args.out)
    device = torch.device(args.device)
    args.layers = args.layers or (2 if args.tiny else None)
    args.seq = args.seq or (128 if args.tiny else 4096)
    tokens = args.tokens or (256 if args.tiny else 8192)
    if tokens % args.seq:
        parser.error(f"--tokens {tokens} is not a multiple of --seq {args.seq}")
    args.batch = tokens // args.seq
    args.steps = args.steps or (2 if args.tiny else 8)
    modes = (args.modes or ("eager,compiled" if device.type == "cuda" else "eager")).split(",")
    variants = args.variants.split(",")
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    out = args.out or default_out(device, args.tiny)
    machine = {"host": platform.node(), "torch": torch.__version__,
               "python": platform.python_version(), "device": str(device)}
    try:
        import transformers
        machine["transformers"] = transformers.__version__
    except ImportError:
        parser.error("bench_model needs transformers: pip install 'fp8blk[transformers]'")
    try:
        import torchao
        machine["torchao"] = torchao.__version__
    except Exception:  # noqa: BLE001
        machine["torchao"] = None
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, named by index from here on
            device = torch.device("cuda", torch.cuda.current_device())
        machine["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    cases = []
    for arch in args.arch.split(","):
        for mode in modes:
            for variant in variants:
                c = run_case(arch, variant, mode, args, device)
                cases.append(c)
                print(f"  {arch} {mode} {variant}: "
                      + (c["error"] if "error" in c else
                         f"{c['step_ms']:.1f} ms/step (warm-up {c['warmup_s']:.1f} s)"),
                      flush=True)
    ratios(cases)
    result = {"machine": machine,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([sys.executable] + sys.argv if argv is None
                                  else ["bench/bench_model.py", *argv]),
              "wall_s": time.perf_counter() - t0, "cases": cases}
    print_table(cases)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", out)
    return result


if __name__ == "__main__":
    main()
