"""``python -m fp8blk bench``: the subcommand's parser and run, its progress line, table, JSON
and plot. What is timed and how (cases, timing loops, copy bandwidth, peers) lives in
``timing``; the command line is described in docs/api.md."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

import numpy as np

from .. import _arrays
from ..formats import Block2D, check_mxfp8_shape
from . import positive_int, writable_dir
from .timing import (CASES, cpu_copy_bandwidth, cpu_inputs, cpu_operation,
                     gpu_copy_bandwidth, gpu_inputs, gpu_operation, time_cupy, time_host,
                     time_torch, torch_formulas, torchao_kernels)

GPU_SIZES = (1024, 2048, 4096, 8192, 16384)
CPU_SIZES = (8192,)

# the CPU default: what `python -m fp8blk bench` has always timed (the reference is slow)
CPU_DEFAULT_CASES = ("b1d_row", "b1d_both", "b2d_both", "mx_both")


HELP = """\
What the kernels achieve, as a table, a JSON file and a plot.

On a GPU (unless --cpu): every quantize kernel (Block1D, Block2D, MXFP8; rowwise, columnwise,
both), the Block2D FP8 transpose and the dequantize kernels on bf16 N x N inputs over a sweep of
sizes: median GPU time of back-to-back calls (CUDA events), host time per call, bytes moved,
TB/s and the fraction of a device-to-device copy at the same size; at the largest size
torch.compile of the same formulas and torchao's Triton kernels where installed.

On the CPU: the same cases on float32 inputs through the NumPy reference (the CPU execution
path, not the GPU kernels), best of --reps wall times, against a NumPy copy.

--out DIR writes DIR/bench-{gpu,cpu}-DATE.json and, with matplotlib (pip install
'fp8blk[plot]'), DIR/bench-{gpu,cpu}-DATE.png.
"""


def add_parser(sub):
    """Register the ``bench`` subcommand on an argparse subparsers object."""
    import argparse

    parser = sub.add_parser("bench", help="kernel bandwidth table and plot (GPU), "
                            "reference-path timings (CPU)", description=HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", metavar="DIR",
                        help="write bench-{gpu,cpu}-DATE.json and .png (plot needs matplotlib); "
                             "checked for writing before the benchmark runs")
    parser.add_argument("--sizes", type=positive_int, nargs="+", metavar="N",
                        help=f"N x N inputs (GPU default {' '.join(map(str, GPU_SIZES))}; "
                             f"CPU default {' '.join(map(str, CPU_SIZES))})")
    parser.add_argument("--cases", nargs="+", metavar="CASE",
                        help="subset of: " + " ".join(c.name for c in CASES))
    parser.add_argument("--cpu", action="store_true",
                        help="time the CPU reference path even when a GPU is present")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help="timed repetitions per case (GPU: 7 x 10 calls; CPU: best of 3)")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip torch.compile and torchao (they take minutes to compile)")
    parser.set_defaults(run=run, check=check)
    return parser


def check(args):
    """Usage errors found before the benchmark runs (None when there is none)."""
    known = {c.name for c in CASES}
    unknown = [n for n in args.cases or () if n not in known]
    if unknown:
        return f"unknown --cases {' '.join(unknown)}; choose from {' '.join(sorted(known))}"
    if args.out:
        return writable_dir(args.out, "--out")
    return None


# -- progress ---------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (a line per completed size when not a terminal)."""

    def __init__(self, total, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()

    def step(self, label, milestone=False):
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if self.tty:
            filled = int(30 * self.done / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
                              f" {elapsed:5.0f} s  {label:<32}")
            if self.done == self.total:
                self.stream.write("\n")
        elif milestone or self.done == self.total:
            self.stream.write(f"[{self.done}/{self.total}] {elapsed:.0f} s  {label}\n")
        self.stream.flush()


# -- peers (GPU only) -----------------------------------------------------------------------


def _torch_nbytes(outputs):
    if isinstance(outputs, (tuple, list)):
        return sum(_torch_nbytes(o) for o in outputs)
    return outputs.numel() * outputs.element_size()


def run_peers(n, inputs, copy_bps, results, notes, progress):
    """torch.compile and torchao on the same N x N inputs; appends rows to ``results``."""
    try:
        import torch
    except ImportError:
        notes.append("peers skipped: torch is not installed")
        return
    xs = [torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16) for x in inputs]
    in_bytes = xs[0].numel() * 2
    peers = [("torchao", name, fn) for name, fn in torchao_kernels().items()]
    if not peers:
        notes.append("torchao peers skipped: torchao.prototype.blockwise_fp8_training not "
                     "importable")
    peers += [("torch.compile", name, fn) for name, fn in torch_formulas().items()]
    progress.total += len(peers)
    for kind, name, fn in peers:
        try:
            if kind == "torch.compile":
                fn = torch.compile(fn, dynamic=False)
            args = xs
            if name == "b2d_transpose":
                args = [torch.from_dlpack(_b2d_rowwise_bytes(x)) for x in inputs]
                nbytes = 2 * args[0].numel()
            else:
                nbytes = in_bytes + _torch_nbytes(fn(xs[0]))
            gpu, host, all_gpu = time_torch(fn, args)
            results.append(_row(name, kind, n, gpu, host, nbytes, copy_bps, all_gpu))
        except Exception as exc:  # a peer that fails is reported, not fatal
            notes.append(f"{kind} {name}: {type(exc).__name__}: {str(exc)[:200]}")
        progress.step(f"{kind} {name}")


def _b2d_rowwise_bytes(x):
    from ..kernels import backend as kernels

    return kernels.quantize(x, Block2D(), True, False, dtype=_arrays.BF16)[0]


# -- the run ----------------------------------------------------------------------------------


def _row(case, kind, n, seconds, host_seconds, nbytes, copy_bps, all_seconds=None):
    return {"case": case, "kind": kind, "shape": [n, n], "seconds": seconds,
            "host_seconds_per_call": host_seconds, "bytes": int(nbytes),
            "tb_s": nbytes / seconds / 1e12, "frac_copy": nbytes / seconds / copy_bps,
            "all_seconds": all_seconds}


def _versions(on_gpu):
    """Versions of the modules this run used (on a GPU also the peers': torch, torchao)."""
    out = {"python": sys.version.split()[0]}
    for name in ("numpy", "numba", "numba_cuda", "cupy", "torch", "triton", "torchao"):
        module = sys.modules.get(name)
        if module is None and on_gpu and name in ("cupy", "torch", "torchao"):
            try:
                module = __import__(name)
            except Exception:
                module = None
        if module is not None:
            out[name] = getattr(module, "__version__", "?")
    return out


def _select(names):
    """The cases named (checked by :func:`check`), all without names."""
    known = {c.name: c for c in CASES}
    return [known[n] for n in names] if names else CASES


def run(args) -> int:
    """The ``bench`` subcommand. Returns the exit status."""
    from . import gpu_module

    on_gpu = not args.cpu and gpu_module() is not None
    cases = _select(args.cases)
    if not on_gpu and not args.cases:
        cases = [c for c in CASES if c.name in CPU_DEFAULT_CASES]
    sizes = args.sizes or (GPU_SIZES if on_gpu else CPU_SIZES)
    device = "gpu" if on_gpu else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc)
    report = {"device": device, "date": date.isoformat(timespec="seconds"),
              "command": " ".join(["python -m fp8blk"] + sys.argv[1:]),
              "host": platform.node(), "machine": _machine(on_gpu), "versions": _versions(on_gpu),
              "input_dtype": "bfloat16" if on_gpu else "float32", "sizes": list(sizes),
              "copy_bytes_per_s": {}, "results": [], "notes": []}
    if on_gpu:
        print(f"fp8blk bench: GPU kernels on {report['machine']}, bf16 N x N inputs; GPU time "
              f"by CUDA events, median of back-to-back calls; bytes = inputs + outputs")
    else:
        print("fp8blk bench: CPU REFERENCE PATH (NumPy), not the GPU kernels; float32 N x N "
              "inputs, best of the wall times" + (" (no GPU found)" if not args.cpu else ""))
    peers = on_gpu and not args.no_peers
    progress = Progress(len(sizes) * len(cases))  # run_peers adds its own steps
    for n in sizes:
        copy_bps = _measure_size(n, cases, on_gpu, args, report, progress)
        if peers and n == max(sizes):
            run_peers(n, gpu_inputs(n), copy_bps, report["results"], report["notes"], progress)
        if on_gpu:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
    print_table(report)
    if args.out:
        write(report, args.out, date)
    else:
        print("(pass --out DIR to write the JSON and the plot)")
    return 0


def _machine(on_gpu):
    if not on_gpu:
        return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _measure_size(n, cases, on_gpu, args, report, progress):
    """Time every case at N x N; returns the copy bandwidth measured at that size."""
    inputs = gpu_inputs(n) if on_gpu else cpu_inputs(n)
    nbytes = int(inputs[0].nbytes)
    copy_bps = gpu_copy_bandwidth(nbytes) if on_gpu else cpu_copy_bandwidth(nbytes)
    report["copy_bytes_per_s"][str(n)] = copy_bps
    for case in cases:
        try:
            check_mxfp8_shape(case.recipe, n, n, "the input")
        except ValueError as refused:
            report["notes"].append(f"{case.name} skipped at {n}: {refused}")
            progress.step(f"{case.name} {n} (skipped)")
            continue
        if on_gpu:
            fn, args_list, moved = gpu_operation(case, inputs)
            reps = args.reps or 7
            gpu, host, all_gpu = time_cupy(fn, args_list, reps=reps)
            row = _row(case.name, "fp8blk", n, gpu, host, moved, copy_bps, all_gpu)
        else:
            fn, args_list, moved = cpu_operation(case, inputs)
            best, median, all_s = time_host(fn, args_list, reps=args.reps or 3)
            row = _row(case.name, "fp8blk reference (CPU)", n, best, best, moved, copy_bps,
                       all_s)
        report["results"].append(row)
        progress.step(f"{case.name} {n}x{n}", milestone=case is cases[-1])
    return copy_bps


def print_table(report):
    """The table at the largest size, with the peers' speedups; smaller sizes summarized."""
    rows = report["results"]
    if not rows:
        return
    largest = max(r["shape"][0] for r in rows)
    ours = [r for r in rows if r["kind"].startswith("fp8blk") and r["shape"][0] == largest]
    peer = {}
    for r in rows:
        if not r["kind"].startswith("fp8blk"):
            peer.setdefault(r["case"], {})[r["kind"]] = r["seconds"]
    copy = report["copy_bytes_per_s"][str(largest)]
    gpu = report["device"] == "gpu"
    # GPU: microseconds, TB/s and the host time per call beside the GPU time; CPU: ms, GB/s
    unit, scale, t_unit, t_scale = ("TB/s", 1e12, "us", 1e6) if gpu else ("GB/s", 1e9, "ms", 1e3)
    print(f"\n{largest}x{largest} {report['input_dtype']}; copy {copy / scale:.2f} {unit}")
    header = f"{'case':<18}{'time ' + t_unit:>10}" + (f"{'host us':>9}" if gpu else "")
    header += f"{unit:>7}{'% copy':>8}"
    if peer:
        header += f"{'vs torch.compile':>18}{'vs torchao':>12}"
    print(header)
    for r in ours:
        line = f"{r['case']:<18}{r['seconds'] * t_scale:>10.1f}"
        if gpu:
            line += f"{r['host_seconds_per_call'] * 1e6:>9.1f}"
        line += f"{r['bytes'] / r['seconds'] / scale:>7.2f}{100 * r['frac_copy']:>7.1f}%"
        if peer:
            for kind, width in (("torch.compile", 18), ("torchao", 12)):
                theirs = peer.get(r["case"], {}).get(kind)
                line += (f"{theirs / r['seconds']:>{width - 1}.2f}x" if theirs
                         else f"{'-':>{width}}")
        print(line)
    if peer:
        print("(vs X: X's time / fp8blk's time at this size; > 1 means fp8blk is faster)")
    smaller = sorted({r["shape"][0] for r in rows} - {largest})
    for n in smaller:
        fracs = [r["frac_copy"] for r in rows if r["shape"][0] == n and
                 r["kind"].startswith("fp8blk")]
        print(f"{n}x{n}: {len(fracs)} cases, {100 * min(fracs):.0f}-{100 * max(fracs):.0f}% "
              f"of copy")
    for note in report["notes"]:
        print("note:", note)


def write(report, out_dir, date):
    """JSON always; the PNG when matplotlib is importable (else say that it was skipped)."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"bench-{report['device']}-{date.strftime('%Y%m%d-%H%M%S')}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {stem}.json")
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install 'fp8blk[plot]')")
        return
    matplotlib.use("Agg")
    plot(report, stem + ".png")
    print(f"wrote {stem}.png")


def plot(report, path):
    """Achieved bandwidth against input size, one line per case, the copy line on top."""
    import matplotlib.pyplot as plt

    gpu = report["device"] == "gpu"
    unit, scale = ("TB/s", 1e12) if gpu else ("GB/s", 1e9)
    rows = report["results"]
    ours = [r for r in rows if r["kind"].startswith("fp8blk")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    groups = (("quantize", lambda c: "dequant" not in c and c != "b2d_transpose"),
              ("transpose and dequantize", lambda c: "dequant" in c or c == "b2d_transpose"))
    sizes = sorted({r["shape"][0] for r in rows})
    mib = [n * n * (2 if gpu else 4) / 2**20 for n in sizes]
    copy = [report["copy_bytes_per_s"][str(n)] / scale for n in sizes]
    for ax, (title, keep) in zip(axes, groups):
        ax.plot(mib, copy, "k-", lw=3, label="device copy" if gpu else "NumPy copy", zorder=5)
        for name in dict.fromkeys(r["case"] for r in ours if keep(r["case"])):
            pts = sorted((r["shape"][0], r["bytes"] / r["seconds"] / scale) for r in ours
                         if r["case"] == name)
            ax.plot([n * n * (2 if gpu else 4) / 2**20 for n, _ in pts], [v for _, v in pts],
                    "o-", ms=3, label=name)
        for r in rows:
            if not r["kind"].startswith("fp8blk") and keep(r["case"]):
                marker = "x" if r["kind"] == "torch.compile" else "+"
                ax.plot(r["shape"][0] ** 2 * 2 / 2**20, r["bytes"] / r["seconds"] / scale,
                        marker, color="gray", ms=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # small sizes are launch-bound: orders of magnitude below copy
        ax.set_xlabel(f"input size, MiB ({report['input_dtype']} N x N)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel(f"achieved {unit} (inputs read + outputs written)")
    where = report["machine"] if gpu else "CPU reference path (NumPy), " + report["machine"]
    peers = " x torch.compile, + torchao" if any(not r["kind"].startswith("fp8blk")
                                                  for r in rows) else ""
    fig.suptitle(f"fp8blk {where}{';' + peers if peers else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
