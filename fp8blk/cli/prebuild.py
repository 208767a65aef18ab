"""``python -m fp8blk prebuild [--cc 90] [--jobs N] [--dir D]``: compile the common kernel
variants (``fp8blk.kernels.backend.common_variants``) into fp8blk's kernel cache ahead of time,
with or without a GPU, so that fresh processes load them instead of compiling (docs/api.md).
Numba holds a global compiler lock, so variants compile in a pool of worker processes; an
interrupted run (Ctrl-C, SIGTERM) stops its workers before it exits, and a worker whose parent
dies is killed with it.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time

from . import positive_int, writable_dir

HELP = """\
Compile the common kernel variants into fp8blk's kernel cache ahead of time, with or without
a GPU, so that fresh processes (every rank of an mpiexec job) load them in well under a
millisecond instead of compiling each for 1-4 s. The variants: quantize for every recipe
(Block1D, Block2D, MXFP8) x E4M3 / E5M2 x fp32 / bf16 / fp16 input x rowwise / columnwise /
both on aligned inputs; dequantize of those buffers to fp32 / bf16 / fp16; the Block2D
transpose; the grouped quantize launches of a default Float8BlockLinear. Other variants
compile on first use, once per cache folder.

The kernels need compute capability 8.9 or newer (sm_89, sm_90, sm_100, sm_120).

examples:
  python -m fp8blk prebuild --jobs 8          # for this machine's GPU, else sm_90
  FP8BLK_CACHE_DIR=/shared/fp8blk python -m fp8blk prebuild --cc 90
"""


def add_parser(sub):
    """Register the ``prebuild`` subcommand on an argparse subparsers object."""
    import argparse

    p = sub.add_parser("prebuild", help="compile the common kernel variants into the cache",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cc", type=compute_capability, default=None,
                   help="target compute capability, 8.9 or newer, e.g. 90 or 9.0 (default: "
                        "this machine's GPU, else 90)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="parallel compiler processes (default: the CPU count)")
    p.add_argument("--dir", default=None,
                   help="cache folder (default: FP8BLK_CACHE_DIR, else ~/.cache/fp8blk)")
    p.set_defaults(run=run, check=check)
    return p


def parse_cc(text):
    """(major, minor) of "90", "9.0", "sm_90a", "100" or "10.0" (ValueError otherwise)."""
    t = str(text).strip().replace("sm_", "").rstrip("a")
    try:
        if "." in t:
            major, minor = t.split(".")
            return int(major), int(minor)
        if t.isdigit() and len(t) >= 2:
            return int(t[:-1]), int(t[-1])
    except ValueError:
        pass
    raise ValueError(f"--cc must look like 90 or 9.0, got {text!r}")


def _supported(cc):
    """A message when the kernels cannot target `cc`, else None."""
    from ..kernels.backend import MIN_CC

    if tuple(cc) < MIN_CC:
        return (f"compute capability {cc[0]}.{cc[1]} is not supported: the kernels use FP8 "
                f"conversions of sm_89 and newer; choose one of 89, 90, 100, 120 (or newer)")
    return None


def compute_capability(text):
    """argparse type of ``--cc``: a supported (major, minor)."""
    import argparse

    try:
        cc = parse_cc(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    problem = _supported(cc)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return cc


def check(args):
    """Usage errors found before any work (None when there is none): the cache turned off, a
    folder that cannot be written, a GPU the kernels cannot target. Fills in ``args.cc``."""
    from ..kernels import backend as kp
    from . import probe_gpu

    if not kp.cache_enabled():
        return ("FP8BLK_KERNEL_CACHE=0 turns the kernel cache off: nothing to prebuild into "
                "(unset it)")
    args.dir = os.path.abspath(args.dir or kp.cache_dir())
    problem = writable_dir(args.dir, "--dir")
    if problem:
        return problem
    if args.cc is None:
        _, _, local = probe_gpu()
        args.cc = local or (9, 0)
        return _supported(args.cc)
    return None


class _Progress:
    """A plain-text progress bar (redrawn in place on a terminal, else a line per 10%)."""

    def __init__(self, total, out=None, width=30):
        out = sys.stdout if out is None else out
        self.total, self.out, self.width = total, out, width
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.t0 = time.perf_counter()
        self.last_tenth = -1

    def show(self, done, note=""):
        frac = done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        line = (f"[{bar}] {done}/{self.total} variants, {time.perf_counter() - self.t0:5.1f} s"
                f" {note}")
        if self.tty:
            self.out.write("\r" + line.ljust(100)[:100])
            if done == self.total:
                self.out.write("\n")
        elif int(frac * 10) > self.last_tenth or done == self.total:
            self.last_tenth = int(frac * 10)
            self.out.write(line + "\n")
        self.out.flush()


def _worker_init():
    """In each worker: Ctrl-C is the parent's to handle (it stops the pool), and on Linux the
    worker is killed when its parent dies, however it dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Pool.terminate's signal ends the worker
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _job(task):
    """Worker: ``(family, spec, (built, seconds) or None, error text or None)``."""
    build, family, spec, cc, root = task
    try:
        return family, spec, build(family, spec, cc, root), None
    except Exception as exc:  # report every failure, keep building the others
        return family, spec, None, f"{type(exc).__name__}: {exc}"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the pool is stopped on the way out."""


def _on_sigterm(signum, frame):
    raise Terminated()


def prebuild(cc, jobs=None, root=None, variants=None, out=None, build=None):
    """Compile `variants` (default ``common_variants()``) for compute capability `cc` into the
    cache folder `root` (default the kernels' cache folder) with `jobs` worker processes;
    `build(family, spec, cc, root) -> (built, seconds)` is the worker's job (default
    ``fp8blk.kernels.backend.build``). Returns a summary dict (counts, seconds, folder,
    errors). On SIGINT / SIGTERM the workers are terminated before the exception propagates."""
    from ..kernels import backend as kp

    if not kp.cache_enabled():
        raise RuntimeError("FP8BLK_KERNEL_CACHE=0 turns the kernel cache off: nothing to "
                           "prebuild into (unset it)")
    root = os.path.abspath(root or kp.cache_dir())
    os.makedirs(root, exist_ok=True)
    variants = kp.common_variants() if variants is None else variants
    total, todo = kp.missing(variants, cc, root)
    cached = total - len(todo)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    t0 = time.perf_counter()
    progress = _Progress(total, out)
    progress.show(cached, "already cached" if cached else "")
    built, errors, done = 0, [], cached
    if todo:
        # fork: workers start without re-importing this process's modules (no numba here)
        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux")
                                          else "spawn")
        tasks = [(build or kp.build, family, spec, tuple(cc), root) for family, spec in todo]
        main = threading.current_thread() is threading.main_thread()  # signals: main only
        prior_handler = signal.signal(signal.SIGTERM, _on_sigterm) if main else None
        pool = ctx.Pool(jobs, initializer=_worker_init)
        try:
            for family, spec, result, error in pool.imap_unordered(_job, tasks):
                if error is None:
                    built += result[0]
                else:
                    errors.append(f"{family} {spec}: {error}")
                done += 1
                progress.show(done, family if error is None else f"{family} FAILED")
            pool.close()
        finally:
            pool.terminate()
            pool.join()
            if main:
                signal.signal(signal.SIGTERM, prior_handler)
    seconds = time.perf_counter() - t0
    return {"variants": total, "compiled": built, "already_cached": cached,
            "seconds": seconds, "dir": root, "cc": list(cc), "jobs": jobs, "errors": errors}


def run(args) -> int:
    cc = args.cc
    try:
        summary = prebuild(cc, args.jobs, args.dir)
    except (KeyboardInterrupt, Terminated) as exc:
        print("\nprebuild interrupted: workers stopped; the variants compiled so far stay "
              "in the cache", file=sys.stderr)
        return 128 + (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
    print(f"prebuilt {summary['variants']} kernel variants for compute capability "
          f"{cc[0]}.{cc[1]}: {summary['compiled']} compiled, {summary['already_cached']} "
          f"already cached, in {summary['seconds']:.1f} s with {summary['jobs']} processes; "
          f"cache folder {summary['dir']}")
    for e in summary["errors"]:
        print("  FAILED", e, file=sys.stderr)
    return 1 if summary["errors"] else 0
