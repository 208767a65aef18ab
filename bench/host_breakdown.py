"""Where the host time of one ``fp8blk.quantize`` call on a small CuPy array goes.

    python3 bench/host_breakdown.py [--out results/host.json] [--n 20000]

Times each stage of the call on its own (256x256 fp32, Block1D rowwise unless told): the
public call, the kernel entry point, array-family dispatch, validation, the launch-plan lookup,
the one allocation and its views, the raw launch, and the BlockTensor. Each figure is the
minimum and the median over 7 repeats of n back-to-back calls (the minimum is the cost, the
spread is the host's noise), with the GPU synchronized after each repeat. Also times the public
call with Python's cyclic GC off, to see whether collections explain the run-to-run spread.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cupy  # noqa: E402

import fp8blk as fb  # noqa: E402
from fp8blk import _arrays, kernels, ops  # noqa: E402
from fp8blk.kernels import _host  # noqa: E402
from fp8blk.kernels.quantize import _plan_for, kind_of  # noqa: E402


def timed(fn, n, repeats=7):
    for _ in range(min(n, 500)):
        fn()
    cupy.cuda.Device().synchronize()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        cupy.cuda.Device().synchronize()
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    return min(per_call), statistics.median(per_call)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    x = cupy.random.standard_normal((256, 256), dtype=np.float32)
    rec = fb.Block1D()
    plan = _plan_for(rec, kind_of(x, None), 256, 256, True, False,
                           _host.data_ptr(x) % 16 == 0)
    outs = _host.alloc_views(cupy, plan.nbytes, plan.shapes, plan.offsets)
    launch_args = (x, outs[0], outs[1], x, x) + plan.scalars
    stages = {
        "fb.quantize (public call)": lambda: fb.quantize(x, rec),
        "fb.quantize row+col": lambda: fb.quantize(x, rec, rowwise=True, columnwise=True),
        "fb.quantize MXFP8 row": lambda: fb.quantize(x, fb.MXFP8()),
        "kernels.quantize (entry point)": lambda: kernels.quantize(x, rec, True, False),
        "_arrays.to_backend": lambda: _arrays.to_backend(x),
        "ops._validate": lambda: ops._validate(x, x.dtype, "cupy", rec, True, False),
        "backend_for": lambda: ops.backend_for(x),
        "plan lookup (_plan_for)": lambda: _plan_for(rec, 0, 256, 256, True, False, True),
        "kind_of": lambda: kind_of(x, None),
        "data_ptr": lambda: _host.data_ptr(x),
        "alloc_views (1 alloc + 2 views)":
            lambda: _host.alloc_views(cupy, plan.nbytes, plan.shapes, plan.offsets),
        "cupy.cuda.alloc": lambda: cupy.cuda.alloc(plan.nbytes),
        "cupy.ndarray view": lambda: cupy.ndarray((256, 256), np.uint8, memptr=x.data),
        "launch (Function call, 7 args)":
            lambda: plan.kernel(plan.grid, plan.block, launch_args),
        "BlockTensor(...)": lambda: fb.BlockTensor(x.shape, rec, outs[0], outs[1], None, None,
                                                   dtype=x.dtype, family="cupy"),
        "hash(recipe)": lambda: hash(rec),
    }
    try:  # the torch CUDA path: DLPack import of the input, export of each output
        import torch

        xt = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        qt = fb.quantize(xt, rec)
        stages.update({
            "fb.quantize torch bf16": lambda: fb.quantize(xt, rec),
            "torch: _arrays.to_backend (DLPack in)": lambda: _arrays.to_backend(xt),
            "torch: cupy.from_dlpack alone": lambda: cupy.from_dlpack(xt.view(torch.int16)),
            "torch: output buffer (DLPack out)": lambda: qt.rowwise_data,
            "torch: current_stream().cuda_stream":
                lambda: torch.cuda.current_stream().cuda_stream,
        })
    except ImportError:
        pass
    res = {}
    for name, fn in stages.items():
        lo, med = timed(fn, args.n if "quantize" in name or "launch" in name else args.n)
        res[name] = {"min_us": lo, "median_us": med}
        print(f"{name:40s} min {lo:6.2f} us  median {med:6.2f} us", flush=True)
    gc.disable()
    lo, med = timed(lambda: fb.quantize(x, rec), args.n)
    gc.enable()
    res["fb.quantize, gc disabled"] = {"min_us": lo, "median_us": med}
    print(f"{'fb.quantize, gc disabled':40s} min {lo:6.2f} us  median {med:6.2f} us")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"machine": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "host": platform.node(), "cpu": platform.processor(),
                       "date": time.strftime("%Y-%m-%d"),
                       "command": "python3 bench/host_breakdown.py " + " ".join(sys.argv[1:]),
                       "stages": res}, f, indent=1)


if __name__ == "__main__":
    main()
