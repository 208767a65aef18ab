"""FSDP2 step time at N = 2..1024 ranks, projected on the CPU from measured figures: bf16
parameters against FP8 weights (modes ``primary`` and ``cast``), over NVLink and over a
network of 25 / 50 / 100 GB/s per GPU, with the rank count where FP8 weights start to pay.

Inputs (committed results, each a command-line option; a missing file falls back to the
dated name of the same benchmark and machine, the newest by name):

* the single-GPU FSDP2 step (``bench_fsdp.py`` at world size 1, ``--single``): per case the
  GPU step time ``step_gpu_ms`` (compute with nothing on the wire: FSDP2's hooks, copy-in/out
  and the per-step FP8 cast all run), the cast's own GPU time ``fp8_cast_gpu_ms`` and the host
  time to issue the step ``step_host_ms``;
* the two-GPU all-gather curve (``bench_gather.py`` on NCCL, case ``raw_nccl``, ``--gather``):
  GPU time t of an all-gather of S bytes per rank at N = 2;
* every multi-GPU FSDP2 result (``--measured``; each section of a file, one token count, is
  a run): only to validate against, never fitted to.

Model, per GPU, per step; L layers of P bytes each (bf16 parameters: 2 bytes per element;
width and layer count from the single-GPU file), weak scaling (the per-GPU tokens fixed, so
per-GPU compute is the single-GPU step's at every N):

1. Collective time. Bus bandwidth, the nccl-tests convention: busbw = bytes_total (N-1)/N / t
   with bytes_total = N S the gathered output, so at N = 2 busbw = S / t. NCCL's ring moves
   S bytes per rank in each of its N-1 steps (all-gather and reduce-scatter alike), so
   ``t(S, N) = lat(N) + (N-1) S / B(S)``. The latency is NCCL's own tuning model for ring,
   protocol Simple (NVIDIA/nccl, src/graph/tuning.cc at b6475625: baseLat 8.4 us, hwLat per
   ring step 3.4 us over NVLink and 14.0 us over the network, nInterSteps = nNodes - 1 of the
   N - 1 steps at the network's figure), ``latencyInter`` taken as 0. B(S), the link's
   bandwidth at S bytes per rank, comes from the measured curve with that latency taken off:
   B(S) = S / (t_2(S) - lat(2)), interpolated linearly in log S between the measured sizes and
   held at the end values outside them (FSDP's shards at large N are below the smallest
   measured 1 MiB: there B is the 1 MiB figure and the latency dominates anyway).
2. Links. ``nvlink``: all N ranks on one NVLink domain at the two-GPU curve (for N > 8 an
   NVLink domain of that size, e.g. NVL72, is assumed; an 8-GPU NVSwitch node reaches a
   somewhat higher busbw than two GPUs, not modelled). A number G (GB/s per GPU): nodes of
   ``--gpus-per-node`` GPUs (default 1: every GPU on its own network port, the setting of a
   two-GPU run with NCCL's P2P and shared-memory transports off); once a collective spans
   more than one node, B(S) is capped at G (NCCL's inter-node ring bandwidth is that of one
   GPU's NIC) and the latency counts the inter-node steps at the network figure; within one
   node it is the NVLink case.
3. Bytes. All-gather per layer: S = P / N bytes per rank in bf16; FP8 weights send
   ``fp8_byte_ratio`` times that (FP8 bytes, 1 per element; default: the measured
   ``bytes_vs_bf16`` of the multi-GPU FSDP2 results, 0.5: for Block2D the scales are
   replicated by the cast's all-reduce, not gathered; see docs/torch.md). Reduce-scatter of
   the gradients per layer: bf16 in every mode (bench_fsdp's parameters are bf16 in every case,
   and FSDP2 reduces in the parameter dtype), S = P / N per rank, at the all-gather's curve
   (NCCL's ring reduce-scatter moves the same bytes per step; its reduction is not modelled).
4. Schedule (FSDP2, ``reshard_after_forward=True`` on every layer: each layer gathered in
   forward and again in backward, 2 L all-gathers and L reduce-scatters per step, as the
   measured ``bytes_sent_per_step`` shows). All collectives of one process group run in
   order on one NCCL stream. Forward: the first gather is exposed, layer i+1's gather overlaps
   layer i's forward (implicit prefetch): exposed max(0, g - c_f) each. Backward: the first
   gather (layer L, resharded after forward) is exposed; during layer j's backward the NCCL
   stream runs layer j-1's prefetched gather and layer j+1's reduce-scatter: exposed
   max(0, g + r - c_b) (no gather during layer 1's, no reduce-scatter during layer L's); layer
   1's reduce-scatter is exposed at the end (the optimizer needs it). Per-layer compute: the
   single-GPU step less its FP8 cast, split evenly over the L layers and 1 : 2 between forward
   and backward (one GEMM in forward, two in backward). NCCL's kernels are assumed not to slow
   the GEMMs they overlap.
5. FP8 cast: the single-GPU ``fp8_cast_gpu_ms`` over N (each rank casts its own shard), plus
   one small all-reduce (the scales or amaxes: one per step for the modelled single-recipe
   model) at NCCL's latency for tree or ring, protocol LL, whichever is lower (tuning.cc as
   above); its bytes are not counted. Cast mode's one-pass tile-local cast needs shards of
   whole 128-row tiles (width / N a multiple of 128); beyond that the two-pass cast runs, not
   modelled separately (the cast is a small term there).
6. Shard work: the optimizer step (bench_fsdp's SGD without momentum: bf16 parameters, or
   mode primary's fp32 masters) and mode primary's ``master_grads_`` copy run on each rank's
   shard, 1/N of the single-GPU work, estimated from their HBM bytes (``OPTIMIZER_BYTES`` per
   parameter at the H200's measured copy bandwidth, ``--hbm-tbs``): at one GPU 0.39 ms for
   bf16 and cast, 1.16 ms for primary (primary's single-GPU step less its cast exceeds bf16's
   by 0.80 ms, the estimate's difference is 0.77). Everything else (FSDP2's copy-in/out, the
   quantize kernels) is held constant; at N = 1 FSDP2 also copies each layer through its
   one-rank all-gather, counted again at N > 1 (about 65 us per gather, mostly overlapped).
7. Host: the step cannot end before the host has issued it; the projection is
   max(GPU model, single-GPU ``step_host_ms``). The host time at N > 1 is not an input:
   FSDP2 issues real collectives there, and a step whose host time exceeds the GPU model's
   is host-bound beyond what this projects.

FP8 pays where its step time is below bf16's; the crossover is the smallest N (2..1024) from
which it does. Validation: the same model at each measured multi-GPU result's world size and
link (NVLink), with the relative error (projection - measured) / measured; a measured result
whose width, layers and tokens the single-GPU input does not cover is listed as not validated.

Run (writes the table to stdout, JSON and PNG; matplotlib optional):

    python3 -m bench.project_fsdp
    python3 -m bench.project_fsdp --fp8-byte-ratio 1.0 --out /tmp/p.json --plot /tmp/p.png
"""
from __future__ import annotations

import argparse
import bisect
import datetime
import glob
import json
import math
import os
import sys

from bench import sections

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

MODES = ("primary", "cast")
CASES = ("bf16",) + MODES

# NVIDIA/nccl src/graph/tuning.cc at b6475625 (microseconds)
RING_SIMPLE_BASE_US = 8.4
RING_SIMPLE_HOP_US = {"nvlink": 3.4, "net": 14.0}
LL_BASE_US = {"ring": 6.6, "tree": 6.8}
LL_HOP_US = {"ring": {"nvlink": 0.6, "net": 2.7}, "tree": {"nvlink": 0.6, "net": 5.0}}
# H200 device-to-device copy, read + write counted (bench/README.md, Method)
HBM_TBS = 4.18
# HBM bytes per parameter of the work done on each rank's shard after backward: SGD without
# momentum reads the parameter and its gradient and writes the parameter (bf16: 6 B; fp32
# masters: 12 B); mode primary also copies the bf16 gradient into the fp32 master's (2 + 4 B)
OPTIMIZER_BYTES = {"bf16": 6, "cast": 6, "primary": 18}


def resolve(path, fallbacks):
    """``path`` if it exists, else the newest by name of the glob patterns ``fallbacks``
    (relative to the results folder), else ``path`` (the caller reports it missing)."""
    if os.path.exists(path):
        return path
    for pattern in fallbacks:
        hits = sorted(glob.glob(os.path.join(RESULTS, pattern)))
        if hits:
            return hits[-1]
    return path


def load(path):
    with open(path) as f:
        return json.load(f)


def first_run(path):
    """The first run (section) of a bench_fsdp result file."""
    return next(iter(sections(load(path)).values()))


class Curve:
    """B(S): the link's bandwidth (bytes/s) at S bytes per rank, from two-GPU all-gather times
    with NCCL's two-rank ring latency taken off. ``points``: [(S bytes, t seconds)] at N = 2."""

    def __init__(self, points):
        pts = sorted(points)
        lat2 = ring_latency_s(2, 1)
        self.log_s = [math.log(s) for s, _ in pts]
        self.bw = [s / max(t - lat2, 1e-9) for s, t in pts]
        self.busbw = [(s, t, s / t) for s, t in pts]  # busbw at N = 2: S (N-1) / t

    def __call__(self, s):
        x = math.log(s)
        if x <= self.log_s[0]:
            return self.bw[0]
        if x >= self.log_s[-1]:
            return self.bw[-1]
        i = bisect.bisect_right(self.log_s, x)
        f = (x - self.log_s[i - 1]) / (self.log_s[i] - self.log_s[i - 1])
        return self.bw[i - 1] + f * (self.bw[i] - self.bw[i - 1])


def ring_latency_s(n, nodes):
    """NCCL's ring/Simple latency of an all-gather or reduce-scatter over n ranks on
    ``nodes`` nodes: base + (n-1 - (nodes-1)) NVLink steps + (nodes-1) network steps."""
    inter = nodes - 1
    us = (RING_SIMPLE_BASE_US + (n - 1 - inter) * RING_SIMPLE_HOP_US["nvlink"]
          + inter * RING_SIMPLE_HOP_US["net"])
    return us * 1e-6


def small_allreduce_s(n, nodes, per_node):
    """NCCL's LL latency of a tiny all-reduce, the lower of ring and tree."""
    hw = "net" if nodes > 1 else "nvlink"
    ring = LL_BASE_US["ring"] + 2 * (n - 1) * LL_HOP_US["ring"][hw]
    tree = LL_BASE_US["tree"] + 2 * ((per_node - 1) * LL_HOP_US["tree"]["nvlink"]
                                     + math.log2(nodes) * LL_HOP_US["tree"]["net"])
    return min(ring, tree) * 1e-6


class Link:
    """``name``: 'nvlink' or a per-GPU network bandwidth in GB/s."""

    def __init__(self, name, curve, gpus_per_node):
        self.name = name
        self.curve = curve
        self.cap = None if name == "nvlink" else float(name) * 1e9
        self.gpus_per_node = gpus_per_node

    def nodes(self, n):
        return 1 if self.cap is None else -(-n // self.gpus_per_node)

    def collective_s(self, s, n):
        """All-gather (or reduce-scatter) of s bytes per rank over n ranks, seconds."""
        nodes = self.nodes(n)
        bw = self.curve(s)
        if nodes > 1:
            bw = min(bw, self.cap)
        return ring_latency_s(n, nodes) + (n - 1) * s / bw

    def allreduce_small_s(self, n):
        nodes = self.nodes(n)
        return small_allreduce_s(n, nodes, n // nodes)


def step_ms(single, case, n, link, layer_bytes, layers, fp8_ratio, hbm_tbs=HBM_TBS,
            host_floor=True):
    """Projected GPU step (ms) of ``case`` at n ranks and its parts. ``single``: the
    single-GPU result of that case (step_gpu_ms, fp8_cast_gpu_ms, step_host_ms)."""
    cast1 = single.get("fp8_cast_gpu_ms") or 0.0
    params = layers * layer_bytes / 2
    opt1 = OPTIMIZER_BYTES[case] * params / (hbm_tbs * 1e12) * 1e3
    core = single["step_gpu_ms"] - cast1 - opt1
    c_layer = core / layers
    c_f, c_b = c_layer / 3, 2 * c_layer / 3
    shard = layer_bytes / n
    ratio = fp8_ratio if case in MODES else 1.0
    g = link.collective_s(shard * ratio, n) * 1e3
    r = link.collective_s(shard, n) * 1e3
    fwd = g + (layers - 1) * max(0.0, g - c_f)
    bwd = g
    for j in range(layers, 0, -1):
        comm = (g if j > 1 else 0.0) + (r if j < layers else 0.0)
        bwd += max(0.0, comm - c_b)
    bwd += r
    cast = cast1 / n + link.allreduce_small_s(n) * 1e3 if case in MODES else 0.0
    opt = opt1 / n
    gpu = core + opt + cast + fwd + bwd
    host = single.get("step_host_ms") or 0.0
    total = max(gpu, host) if host_floor else gpu
    return {"step_ms": total, "gpu_model_ms": gpu, "compute_ms": core, "optimizer_ms": opt,
            "cast_ms": cast,
            "gather_ms": g, "reduce_scatter_ms": r, "exposed_comm_ms": fwd + bwd,
            "host_floor_binds": host_floor and host > gpu}


def by_case(result):
    return {c["case"]: c for c in result["cases"]}


def crossover(single, link, mode, ranks, **kw):
    """Smallest n in ``ranks`` from which ``mode`` is faster than bf16 at every larger n in
    ``ranks``; None if it is not faster at the largest."""
    found = None
    for n in reversed(ranks):
        if step_ms(single[mode], mode, n, link, **kw)["step_ms"] < \
                step_ms(single["bf16"], "bf16", n, link, **kw)["step_ms"]:
            found = n
        else:
            break
    return found


def measured_files(patterns):
    """Multi-GPU FSDP2 runs (world >= 2), one per distinct run (date + command): [(label,
    run)], the label the file's path, with ``#<section>`` for a file of sections."""
    seen, out = set(), []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                runs = sections(load(path))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            for section, res in runs.items():
                cases = res.get("cases") or []
                if not cases or (cases[0].get("world") or 1) < 2:
                    continue
                key = (res.get("date"), res.get("command"))
                if key not in seen:
                    seen.add(key)
                    out.append((path if section is None else f"{path}#{section}", res))
    return out


_SLOWED = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")


def network_gbps(res):
    """None for a run on NVLink; for a run with the interconnect slowed (NCCL's P2P or
    shared-memory transport off in its command, or an ``interconnect`` other than 'nvlink')
    the bus bandwidth it reports in GB/s (a top-level key naming ``busbw``), or False."""
    slowed = any(k in (res.get("command") or "") for k in _SLOWED) or \
        res.get("interconnect", "nvlink") != "nvlink"
    if not slowed:
        return None
    for key, value in res.items():
        if "busbw" in key and isinstance(value, (int, float)):
            return value
    return False


def validate(single_res, measured, curve, gpus_per_node, kw):
    """Projection vs every measured multi-GPU step: NVLink, or for a slowed run the network
    case at the bus bandwidth it reports, one GPU per node. ``kw``: step_ms's model options."""
    single = by_case(single_res)
    base = single_res["cases"][0]
    rows = []
    for path, res in measured:
        gbps = network_gbps(res)
        slowed = gbps is not None and gbps is not False
        link = Link(str(gbps) if slowed else "nvlink", curve, 1 if slowed else gpus_per_node)
        for c in res["cases"]:
            if c["case"] not in CASES or c.get("step_gpu_ms") is None:
                continue
            row = {"file": os.path.relpath(path, os.path.dirname(HERE)), "case": c["case"],
                   "world": c["world"], "tokens": c["tokens"],
                   "link": "slowed, bandwidth unknown" if gbps is False else link.name,
                   "measured_ms": c["step_gpu_ms"]}
            same = all(c.get(k) == base.get(k) for k in ("width", "layers", "tokens"))
            if gbps is False:
                row.update(projected_ms=None, rel_err=None,
                           note="not validated: slowed interconnect of unknown bandwidth")
            elif not same or c["case"] not in single:
                row.update(projected_ms=None, rel_err=None,
                           note="not validated: no single-GPU step at width "
                                f"{c.get('width')}, {c.get('layers')} layers, "
                                f"{c.get('tokens')} tokens")
            else:
                p = step_ms(single[c["case"]], c["case"], c["world"], link, **kw)
                row.update(projected_ms=p["step_ms"],
                           rel_err=(p["step_ms"] - c["step_gpu_ms"]) / c["step_gpu_ms"])
            rows.append(row)
    # FP8 against bf16 within one measured run: the ratio the projection has to get right
    for row in rows:
        ref = next((r for r in rows if r["file"] == row["file"] and r["case"] == "bf16"), None)
        if ref is not None:
            row["measured_vs_bf16"] = ref["measured_ms"] / row["measured_ms"]
            row["projected_vs_bf16"] = (ref["projected_ms"] / row["projected_ms"]
                                        if row["projected_ms"] and ref["projected_ms"]
                                        else None)
    return rows


def plot(path, table, links, ranks, checks=()):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"primary": "-", "cast": "--"}
    for i, link in enumerate(links):
        color = f"C{i}"
        for mode in MODES:
            ys = [table[(link, n)][mode]["speedup_vs_bf16"] for n in ranks]
            label = ("NVLink" if link == "nvlink" else f"{link} GB/s") + f", {mode}"
            ax.plot(ranks, ys, styles[mode], color=color, marker="o", ms=3, label=label)
    marks = {"primary": "x", "cast": "+"}
    for v in checks:
        # only the runs of the projected configuration (the same tokens per GPU)
        if v["case"] in MODES and v.get("projected_vs_bf16") and v["link"] in links:
            ax.plot([v["world"]], [v["measured_vs_bf16"]], marks[v["case"]], color="k",
                    ms=9, label=f"measured {v['case']}, {v['link']}, {v['tokens']} tokens")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bf16 step time / FP8-weight step time")
    ax.set_title("FSDP2 projection: FP8 weights vs bf16 parameters (above 1: FP8 pays)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--single", default=os.path.join(RESULTS, "fsdp-h200.json"),
                   help="single-GPU bench_fsdp result (falls back to fsdp-h200x1*.json)")
    p.add_argument("--gather", default=os.path.join(RESULTS, "gather-nccl-h200x2.json"),
                   help="two-GPU bench_gather NCCL result (falls back to "
                        "gather-nccl-h200x2-*.json)")
    p.add_argument("--measured", nargs="*", default=None,
                   help="multi-GPU bench_fsdp results to validate against (default: every "
                        "fsdp-h200x<N>*.json with world >= 2 in bench/results)")
    p.add_argument("--links", default="nvlink,25,50,100",
                   help="'nvlink' and per-GPU network bandwidths in GB/s")
    p.add_argument("--ranks", default=",".join(str(2 ** k) for k in range(1, 11)))
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="GPUs per node in the network cases (NVLink within a node)")
    p.add_argument("--fp8-byte-ratio", type=float, default=None,
                   help="FP8 all-gather bytes / bf16's (default: measured bytes_vs_bf16)")
    p.add_argument("--hbm-tbs", type=float, default=HBM_TBS,
                   help="HBM bandwidth (TB/s, read + write) for the per-shard optimizer work")
    p.add_argument("--no-host-floor", action="store_true",
                   help="drop the single-GPU host time as the step's floor")
    p.add_argument("--out", default=os.path.join(RESULTS, "fsdp-projection.json"))
    p.add_argument("--plot", default=os.path.join(RESULTS, "fsdp-projection.png"))
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    single_path = resolve(args.single, ["fsdp-h200x1.json", "fsdp-h200x1-*.json"])
    gather_path = resolve(args.gather, ["gather-nccl-h200x2-*.json"])
    single_res, gather_res = first_run(single_path), load(gather_path)
    if gather_res.get("ranks") != 2:
        raise SystemExit(f"{gather_path}: a two-rank all-gather curve is needed")
    curve = Curve([(r["bytes_per_rank"], r["gpu_us"] * 1e-6)
                   for r in gather_res["results"] if r["case"] == "raw_nccl"])
    patterns = args.measured
    if patterns is None:
        patterns = [os.path.join(RESULTS, "fsdp-h200x*.json")]
    measured = measured_files(patterns)
    ratio = args.fp8_byte_ratio
    if ratio is None:
        seen = [c["bytes_vs_bf16"] for _, res in measured for c in res["cases"]
                if c["case"] in MODES and c.get("bytes_vs_bf16")]
        ratio = seen[0] if seen else 0.5
    single = by_case(single_res)
    base = single_res["cases"][0]
    layers, width = base["layers"], base["width"]
    kw = {"layer_bytes": 2 * width * width, "layers": layers, "fp8_ratio": ratio,
          "hbm_tbs": args.hbm_tbs, "host_floor": not args.no_host_floor}
    links = args.links.split(",")
    ranks = [int(n) for n in args.ranks.split(",")]
    link_of = {name: Link(name, curve, args.gpus_per_node) for name in links}

    table, rows = {}, []
    for name in links:
        for n in ranks:
            per = {c: step_ms(single[c], c, n, link_of[name], **kw) for c in CASES}
            for c in CASES:
                per[c]["speedup_vs_bf16"] = per["bf16"]["step_ms"] / per[c]["step_ms"]
                rows.append({"link": name, "ranks": n, "case": c,
                             **{k: (round(v, 4) if isinstance(v, float) else v)
                                for k, v in per[c].items()}})
            table[(name, n)] = per
    every = list(range(2, max(ranks) + 1))
    cross = {name: {m: crossover(single, link_of[name], m, every, **kw) for m in MODES}
             for name in links}
    checks = validate(single_res, measured, curve, args.gpus_per_node, kw)

    out = []
    out.append(f"FSDP2 projection: {layers} layers of {width}x{width}, "
               f"{base['tokens']} tokens per GPU; FP8 bytes {ratio:g}x bf16's; inputs "
               f"{os.path.basename(single_path)}, {os.path.basename(gather_path)}")
    out.append("busbw at N=2 (raw NCCL all-gather, busbw = bytes_total (N-1)/N / t): " +
               ", ".join(f"{s / 2 ** 20:g} MiB {bw / 1e9:.0f} GB/s"
                         for s, _, bw in curve.busbw))
    out.append(f"{'link':>7} {'N':>5} | {'bf16 ms':>8} {'primary':>8} {'cast':>8} | "
               f"{'prim x':>6} {'cast x':>6} | {'AG bf16':>8} {'AG fp8':>7} {'exposed bf16':>12}")
    for name in links:
        for n in ranks:
            per = table[(name, n)]
            out.append(f"{name:>7} {n:>5} | {per['bf16']['step_ms']:8.2f} "
                       f"{per['primary']['step_ms']:8.2f} {per['cast']['step_ms']:8.2f} | "
                       f"{per['primary']['speedup_vs_bf16']:6.3f} "
                       f"{per['cast']['speedup_vs_bf16']:6.3f} | "
                       f"{per['bf16']['gather_ms']:8.3f} {per['cast']['gather_ms']:7.3f} "
                       f"{per['bf16']['exposed_comm_ms']:12.2f}")
    out.append("crossover (smallest N from which FP8 weights are faster, up to "
               f"{max(ranks)}): " + "; ".join(
                   f"{name}: " + ", ".join(f"{m} {cross[name][m]}" for m in MODES)
                   for name in links))
    out.append("validation against measured multi-GPU steps:")
    for v in checks:
        if v["projected_ms"] is None:
            out.append(f"  {v['file']} {v['case']} N={v['world']}: measured "
                       f"{v['measured_ms']:.2f} ms, {v['note']}")
        else:
            out.append(f"  {v['file']} {v['case']} N={v['world']} tokens={v['tokens']}: "
                       f"measured {v['measured_ms']:.2f} ms, projected {v['projected_ms']:.2f}"
                       f" ms, error {100 * v['rel_err']:+.1f}%; bf16 / case measured "
                       f"{v['measured_vs_bf16']:.3f}, projected {v['projected_vs_bf16']:.3f}")
    note = None if args.no_plot else plot(args.plot, table, links, ranks, checks)
    if note:
        out.append(note)
    print("\n".join(out))

    report = {
        "machine": "projection (CPU)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([os.path.basename(sys.executable)] +
                            [os.path.relpath(__file__, os.path.dirname(HERE))] +
                            (sys.argv[1:] if argv is None else list(argv))),
        "inputs": {"single_gpu": os.path.basename(single_path),
                   "gather_curve": os.path.basename(gather_path),
                   "measured": [os.path.basename(p) for p, _ in measured]},
        "model": {"layers": layers, "width": width, "tokens_per_gpu": base["tokens"],
                  "fp8_byte_ratio": ratio, "gpus_per_node": args.gpus_per_node,
                  "host_floor": not args.no_host_floor, "hbm_tbs": args.hbm_tbs,
                  "optimizer_bytes_per_param": OPTIMIZER_BYTES,
                  "ring_simple_base_us": RING_SIMPLE_BASE_US,
                  "ring_simple_hop_us": RING_SIMPLE_HOP_US,
                  "latency_source": "NVIDIA/nccl src/graph/tuning.cc at b6475625",
                  "busbw_n2_gb_s": [{"bytes_per_rank": s, "gpu_us": t * 1e6,
                                     "busbw_gb_s": bw / 1e9} for s, t, bw in curve.busbw]},
        "cases": rows,
        "crossover": cross,
        "validation": checks,
        "plot": None if (args.no_plot or note) else os.path.basename(args.plot),
        "plot_note": note,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
