"""Sweep of the build-time knobs of the fused row+col quantize kernels (and of Block2D
rowwise), in one process on the GPU.

    python3 -m bench.profile.sweep_fused --out bench/profile/results/sweep-fused-h200.json [--shape 16384 16384]

For each alternative (a ``fp8blk.kernels._specs.QuantizeSettings``: fused_block1d_threads,
block2d_row_threads, row_scatter, packed_amax, min_blocks_per_sm; passed with
``fp8blk.kernels.quantize.use_settings``, every setting being a field of the kernels' specs and
of their cache keys) it for Block1D, MXFP8 and Block2D row+col, and Block2D rowwise, on
bf16 input:
  * checks the bytes against fp8blk.reference on a 1024x1024 random input that also holds NaN,
    -NaN, +-inf, subnormals, -0 and the bf16 max inside blocks (a mismatch is reported, and
    the timing is still taken);
  * times the public ``fp8blk.kernels.quantize`` at the given shape (default 16384x16384):
    median of 7 x 10 back-to-back calls with CUDA events, 3 rotating inputs;
  * reads the kernel's registers / local bytes (cuFuncGetAttribute).
A failing alternative is reported and the others still run. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import traceback

import numpy as np

import cupy

import fp8blk as fb
from fp8blk.kernels import backend as kernels
from fp8blk.kernels import quantize as kquantize
from fp8blk import reference as ref
from fp8blk._arrays import BF16
from fp8blk.kernels._specs import QuantizeSettings
from fp8blk.kernels.quantize import use_settings
from bench.bench_kernels import copy_bandwidth, time_cupy

# name -> QuantizeSettings overrides (the rest keep the defaults)
ALTERNATIVES = [
    ("default", {}),
    ("packed_off", {"packed_amax": False}),
    ("scatter_off", {"row_scatter": False}),
    ("b1d_512thr", {"fused_block1d_threads": 512}),                     # 64 regs
    ("b1d_512thr_minblk2", {"fused_block1d_threads": 512, "min_blocks_per_sm": 2}),
    ("minblk4", {"min_blocks_per_sm": 4}),         # MXFP8 capped at 64 regs (Block1D: 32, spills)
    ("minblk3", {"min_blocks_per_sm": 3}),         # MXFP8 ~71 regs, 3 CTAs/SM
    ("v3_like", {"fused_block1d_threads": 512, "row_scatter": False, "packed_amax": False}),
    ("b2d_row_512thr", {"block2d_row_threads": 512}),                   # 49 regs, 2 CTAs/SM
    ("b2d_row_512thr_minblk3", {"block2d_row_threads": 512, "min_blocks_per_sm": 3}),
]
CASES = [("b1d_both", fb.Block1D(), True), ("mx_both", fb.MXFP8(), True),
         ("b2d_both", fb.Block2D(), True), ("b2d_row", fb.Block2D(), False)]


def log(*a):
    print(*a, flush=True)


def set_knobs(overrides):
    use_settings(QuantizeSettings(**overrides))  # also drops the launcher's kernels and plans


def special_input(rng, shape=(1024, 1024)):
    """bf16 test input (ml_dtypes array): values over 17 binades, with specials inside row and
    column blocks (NaN, -NaN, +-inf, a zero 128x128 tile, an all-NaN 1x32 block, a tiny-amax
    row, subnormal-only blocks, -0, the bf16 max)."""
    f = rng.standard_normal(shape).astype(np.float32)
    f *= np.exp2(rng.integers(-8, 9, size=shape)).astype(np.float32)
    f.flat[rng.choice(f.size, 16, replace=False)] = [np.nan, -np.nan, np.inf, -np.inf] * 4
    f[128:256, 128:256] = 0.0                           # a zero 128x128 tile
    f[1, :32] = np.nan                                  # an all-NaN 1x32 block
    f[2, :] *= np.float32(2.0 ** -120)                  # tiny amax (scale overflow path)
    x = f.astype(BF16)
    bits = x.view(np.uint16)
    m, k = shape
    sub = rng.integers(1, 0x80, size=k, dtype=np.uint16) | \
        (rng.integers(0, 2, size=k, dtype=np.uint16) << 15)
    bits[5, :] = sub                                    # subnormal-only row blocks
    bits[:, 9] = sub[:m] if m <= k else bits[:, 9]      # subnormal-only column blocks
    bits[6, 0::2] = 0x7FC1                              # NaN in every low half
    bits[7, 1::2] = 0xFFC1                              # -NaN in every high half
    bits[8, :] = 0x8000                                 # -0 row
    bits[8, 3] = 0xFF80                                 # -inf among NaN-free zeros
    bits[40:72, 11] = 0xFF81                            # a 32x1 column block of NaNs
    bits[10, 64:96] = 0xFF7F                            # -bf16 max
    return x


def check(recipe, x, columnwise=True):
    got = kernels.quantize(cupy.asarray(x.view(np.uint16)), recipe, True, columnwise,
                           dtype=BF16)
    want = ref.quantize(x, recipe, True, columnwise)
    errs = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            if (g is None) != (w is None):
                errs.append(f"buffer {i}: {'missing' if g is None else 'unexpected'}")
            continue
        g = g.get()
        gb = np.ascontiguousarray(g).view(np.uint8).reshape(-1)
        wb = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
        if g.shape != w.shape or gb.size != wb.size:
            errs.append(f"buffer {i}: shape {g.shape} vs {w.shape}")
        elif (gb != wb).any():
            errs.append(f"buffer {i}: {(gb != wb).sum()} bytes differ")
    return "; ".join(errs) or None


def kernel_attrs():
    out = {}
    for key, (fn, spec) in kquantize._kernels.items():
        try:
            out["regs"] = int(cupy.cuda.driver.funcGetAttribute(4, fn.ptr))
            out["local_bytes"] = int(cupy.cuda.driver.funcGetAttribute(3, fn.ptr))
            out["threads"] = spec.threads
        except Exception as exc:  # attribute query is informational only
            out["attr_error"] = repr(exc)[:80]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--shape", type=int, nargs=2, default=(16384, 16384))
    ap.add_argument("--only", nargs="*", help="alternative names to run (default: all)")
    ap.add_argument("--cases", nargs="*", help="case names to run (default: all)")
    args = ap.parse_args()
    shape = tuple(args.shape)
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    copy_bps = copy_bandwidth(512 << 20)[0]
    log(f"copy: {copy_bps / 1e12:.2f} TB/s (read + write)")
    xs = []
    for i in range(3):
        rs = cupy.random.RandomState(i)
        x = rs.standard_normal(shape, dtype=np.float32) * np.float32(3.0)
        xs.append((x.view(np.uint32) >> 16).astype(np.uint16))
    xcheck = special_input(rng)
    rows = []
    for name, overrides in ALTERNATIVES:
        if args.only and name not in args.only:
            continue
        for cname, recipe, cw in CASES:
            if args.cases and cname not in args.cases:
                continue
            row = {"alt": name, "knobs": dataclasses.asdict(QuantizeSettings(**overrides)),
                   "case": cname, "shape": list(shape)}
            try:
                set_knobs(overrides)
                row["exact_1024"] = check(recipe, xcheck, cw) or "ok"
                row.update(kernel_attrs())
                bufs = kernels.quantize(xs[0], recipe, True, cw, dtype=BF16)
                nbytes = xs[0].nbytes + sum(int(b.nbytes) for b in bufs if b is not None)
                del bufs
                t, ts = time_cupy(lambda x: kernels.quantize(x, recipe, True, cw,
                                                              dtype=BF16), xs)
                row.update(us=t * 1e6, tb_s=nbytes / t / 1e12,
                           pct_copy=100 * nbytes / t / copy_bps, all_us=[v * 1e6 for v in ts])
            except Exception as exc:
                row["error"] = traceback.format_exc(limit=3)[-1500:]
                log(f"  {name} {cname} FAILED: {exc!r}"[:300])
            rows.append(row)
            log(f"  {name:20s} {cname:9s} " + (
                f"{row['us']:7.1f} us {row['pct_copy']:5.1f}% copy regs={row.get('regs')} "
                f"local={row.get('local_bytes')} thr={row.get('threads')} "
                f"exact={row.get('exact_1024')}" if "us" in row else "error"))
    set_knobs({})
    log("\n| alternative | case | us | % copy | regs | local B | threads | exact |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "us" in r:
            log(f"| {r['alt']} | {r['case']} | {r['us']:.1f} | {r['pct_copy']:.1f} | "
                f"{r.get('regs')} | {r.get('local_bytes')} | {r.get('threads')} | "
                f"{r.get('exact_1024')} |")
        else:
            log(f"| {r['alt']} | {r['case']} | error | | | | | {r.get('exact_1024')} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                   "date": datetime.date.today().isoformat(),
                   "command": "python3 -m bench.profile.sweep_fused " + " ".join(sys.argv[1:]),
                   "copy_tb_s": copy_bps / 1e12, "rows": rows}, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
