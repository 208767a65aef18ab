"""``python -m fp8blk prebuild [--cc 90] [--jobs N] [--dir D]``: compile the common kernel
variants into fp8blk's kernel cache ahead of time, with or without a GPU.

A Numba compile takes 1-4 s per kernel variant, paid by every fresh process (every rank of an
``mpiexec`` job) on first use. With the variants prebuilt, a process loads each from the cache
folder in well under a millisecond and never imports numba. The variants: quantize for every
recipe (Block1D, Block2D, MXFP8 with their default options) x E4M3 / E5M2 x fp32 / bf16 /
fp16 input x rowwise / columnwise / both, on aligned inputs (K a multiple of 8, M of 16,
16-byte aligned data); dequantize of each of those buffers (aligned) to fp32 / bf16 / fp16;
the Block2D transpose. Other variants (unaligned shapes, other recipe options, the
master-weight kernels) still compile on first use, once per cache folder.

The cubins are made by the same route as a miss on the GPU (``kernels._compiled``), so they
are the bytes a launch would have compiled. Numba holds a global compiler lock, so variants
compile in a pool of processes, not threads.

Example::

    python -m fp8blk prebuild --jobs 8          # for this machine's GPU, else sm_90
    FP8BLK_CACHE_DIR=/shared/fp8blk python -m fp8blk prebuild --cc 90
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time


def add_parser(sub):
    """Register the ``prebuild`` subcommand on an argparse subparsers object."""
    p = sub.add_parser("prebuild", help="compile the common kernel variants into the cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cc", default=None,
                   help="target compute capability, e.g. 90 or 9.0 (default: this machine's "
                        "GPU, else 90)")
    p.add_argument("--jobs", type=int, default=None,
                   help="parallel compiler processes (default: the CPU count)")
    p.add_argument("--dir", default=None,
                   help="cache folder (default: FP8BLK_CACHE_DIR, else ~/.cache/fp8blk)")
    p.set_defaults(run=run)
    return p


def parse_cc(text):
    """(major, minor) of "90", "9.0", "100" or "10.0"."""
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


def _local_cc():
    """The current GPU's compute capability, or None without CuPy or a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return parse_cc(cupy.cuda.Device().compute_capability)
    except Exception:
        pass
    return None


def common_variants():
    """[(family, spec)] of the variants ``prebuild`` compiles (default settings)."""
    import fp8blk as fb
    from .kernels import _specs as sp
    from .kernels.dequantize import choose_path
    from .kernels.quantize import spec_for

    recipes = [r(fmt) for r in (fb.Block1D, fb.Block2D, fb.MXFP8) for fmt in (fb.E4M3, fb.E5M2)]
    out = []
    for recipe in recipes:
        for kind in (sp.F32, sp.BF16, sp.F16):
            for rw, cw in ((True, False), (False, True), (True, True)):
                out.append(("quantize", spec_for(recipe, kind, rw, cw, True, True,
                                                 settings=sp.QuantizeSettings())))
    kinds = {fb.Block1D: sp.BLOCK1D, fb.Block2D: sp.BLOCK2D, fb.MXFP8: sp.MXFP8}
    for recipe in recipes:
        for columnwise in (False, True):
            for out_kind in (sp.F32_OUT, sp.BF16_OUT, sp.F16_OUT):
                spec = sp.DequantizeSpec(kinds[type(recipe)], columnwise, recipe.fmt is fb.E4M3,
                                         out_kind, None)
                # aligned 1024 x 1024 buffers: scale rows of 128 entries, addresses % 16 == 0
                out.append(("dequantize", choose_path(spec, 1024, 1024, 128, 0, 0)))
    out.append(("transpose", sp.TransposeSpec(True, True)))
    return out


def _build(family, spec, cc, root):
    """Worker: the variant into the store at `root`; returns (built, seconds)."""
    from .kernels import _cache, _compiled

    store = _cache.Store(root)
    t0 = time.perf_counter()
    _compiled.entry(family, spec, cc, store=store)
    return store.builds > 0, time.perf_counter() - t0


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


def prebuild(cc, jobs=None, root=None, variants=None, out=None):
    """Compile `variants` (default :func:`common_variants`) for compute capability `cc` into
    the cache folder `root` (default ``_cache.cache_dir()``) with `jobs` processes. Returns
    a summary dict (counts, seconds, folder, errors)."""
    from .kernels import _cache, _compiled

    if not _cache.enabled():
        raise RuntimeError("FP8BLK_KERNEL_CACHE=0 turns the kernel cache off: nothing to "
                           "prebuild into (unset it)")
    root = os.path.abspath(root or _cache.cache_dir())
    os.makedirs(root, exist_ok=True)
    variants = common_variants() if variants is None else variants
    store = _cache.Store(root)
    todo, seen = [], set()
    for family, spec in variants:
        digest, _ = _compiled.key(family, spec, cc)
        if digest in seen:
            continue
        seen.add(digest)
        if store.read(family, digest) is None:
            todo.append((family, spec))
    total = len(seen)
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
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_build, f, s, cc, root): (f, s) for f, s in todo}
            for fut in concurrent.futures.as_completed(futures):
                family, spec = futures[fut]
                try:
                    was_built, _ = fut.result()
                    built += was_built
                except Exception as exc:  # report every failure, keep building the others
                    errors.append(f"{family} {spec}: {type(exc).__name__}: {exc}")
                done += 1
                progress.show(done, family)
    seconds = time.perf_counter() - t0
    return {"variants": total, "compiled": built, "already_cached": cached,
            "seconds": seconds, "dir": root, "cc": list(cc), "jobs": jobs, "errors": errors}


def run(args) -> int:
    cc = parse_cc(args.cc) if args.cc else (_local_cc() or (9, 0))
    summary = prebuild(cc, args.jobs, args.dir)
    print(f"prebuilt {summary['variants']} kernel variants for compute capability "
          f"{cc[0]}.{cc[1]}: {summary['compiled']} compiled, {summary['already_cached']} "
          f"already cached, in {summary['seconds']:.1f} s with {summary['jobs']} processes; "
          f"cache folder {summary['dir']}")
    for e in summary["errors"]:
        print("  FAILED", e, file=sys.stderr)
    return 1 if summary["errors"] else 0
