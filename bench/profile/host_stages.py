"""Where the host time of one public call goes: the stages of a torch ``fb.quantize`` (256^2
bf16, Block1D rowwise: array conversion, backend choice, the kernels' entry with and without
preallocated outputs, allocation, the repeat-call launcher and the launch alone), and with
``--profile`` a cProfile of the hot paths and the host cost of their primitives. It reads
kernel internals (adapters, plan caches) on purpose; ``bench.bench_host`` measures the public
calls.

    python3 -m bench.profile.host_stages [--n 2000] [--profile] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os

import cupy
import numpy as np
import torch

import fp8blk as fb
from bench.bench_host import host_us


def stages(n):
    """{stage: {"min_us", "median_us"}} per call of n back-to-back calls."""
    dev = torch.device("cuda")
    b1 = fb.Block1D()
    from fp8blk import _arrays, _dispatch
    from fp8blk.kernels import backend as K
    from fp8blk.kernels import _adapters as da
    xt = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    bf = _arrays.BF16
    pre = [torch.empty((256, 256), dtype=torch.uint8, device=dev),
           torch.empty((2, 256), dtype=torch.float32, device=dev), None, None]
    cases = {
        "to_internal": lambda: _arrays.to_internal(xt),
        "backend_for": lambda: _dispatch.backend_for(xt),
        "kernels.quantize (entry, allocates)": lambda: K.quantize(xt, b1, True, False, dtype=bf),
        "kernels.quantize (entry, out=)": lambda: K.quantize(xt, b1, True, False, dtype=bf,
                                                              out=pre),
        "torch.empty (256,256) u8": lambda: torch.empty((256, 256), dtype=torch.uint8,
                                                        device=dev),
        "torch.empty x2 via adapter.alloc": lambda: da.TORCH.alloc(
            xt, 0, [((256, 256), np.dtype(np.uint8)), ((2, 256), np.dtype(np.float32)), None,
                    None], None),
        "_cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "BlockTensor(...)": lambda: fb.BlockTensor((256, 256), b1, pre[0], pre[1], None, None,
                                                   dtype=bf, family="torch"),
    }
    # the repeat-call hot path (fp8blk.ops): its launcher alone, and the launch alone
    from fp8blk.kernels import quantize as kq
    fb.quantize(xt, b1)
    tc = kq.repeat_calls.get((torch.Tensor, b1, torch.bfloat16, xt.shape, True, False, True, 0))
    if tc is not None:
        launch_args = [xt.data_ptr(), pre[0].data_ptr(), pre[1].data_ptr(), xt.data_ptr(),
                       xt.data_ptr()] + tc.scalars
        cases["repeat launcher (2 torch.empty + launch)"] = lambda: tc(xt, xt.data_ptr())
        cases["torch_launch alone"] = lambda: da.torch_launch(tc.kernel, tc.grid, tc.block,
                                                               launch_args, 0)
    cases["torch.empty (2,256) f32 device="] = lambda: torch.empty((2, 256),
                                                                    dtype=torch.float32,
                                                                    device=dev)
    cases["xt.new_empty (2,256) f32"] = lambda: xt.new_empty((2, 256), dtype=torch.float32)
    breakdown = {}
    for name, fn in cases.items():
        try:
            lo, med = host_us(fn, n)
        except Exception as exc:  # a stage another tree of fp8blk does not have (A/B runs)
            print(f"  stage {name:44s} n/a ({type(exc).__name__}: {exc})", flush=True)
            continue
        breakdown[name] = {"min_us": round(lo, 2), "median_us": round(med, 2)}
        print(f"  stage {name:44s} min {lo:6.2f}  median {med:6.2f} us", flush=True)
    return breakdown


def profile():
    """cProfile of the hot paths: where each call's host time goes, by function."""
    import cProfile
    import pstats

    from fp8blk.kernels import _adapters as da

    dev = torch.device("cuda")
    b1 = fb.Block1D()
    xt = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    xc = cupy.random.standard_normal((256, 256), dtype=np.float32)
    q = fb.quantize(xt, b1)
    cases = {"torch quantize": lambda: fb.quantize(xt, b1),
             "torch quantize row+col": lambda: fb.quantize(xt, b1, True, True),
             "cupy quantize": lambda: fb.quantize(xc, b1),
             "torch dequantize": lambda: q.dequantize(torch.bfloat16)}
    for name, fn in cases.items():
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20000):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"\n==== {name}: top by tottime (20000 calls)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    # primitives
    from fp8blk.kernels import quantize as kq
    key = next(iter(kq._plans.keys()))
    p = da._params
    pre_u8 = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    prims = {
        "ctypes slot write x7 (ints)": lambda: [p.slots.__setitem__(i, 12345) for i in range(7)],
        "cupy get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "torch.empty (2,256) f32": lambda: torch.empty((2, 256), dtype=torch.float32,
                                                       device=dev),
        "xt.data_ptr()": lambda: xt.data_ptr(),
        "kq._plan_for (hit)": lambda: kq._plan_for(*key),
        "xt.new_empty (2,256) f32": lambda: xt.new_empty((2, 256), dtype=torch.float32),
        "u8 base.as_strided": lambda: pre_u8.as_strided((256, 256), (256, 1), 512),
        "u8 base.view(float32)": lambda: pre_u8.view(torch.float32),
    }
    for name, fn in prims.items():
        lo, med = host_us(fn, 3000)
        print(f"  prim {name:40s} min {lo:6.2f}  median {med:6.2f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true",
                    help="only cProfile 20000 calls of each hot path and print the top entries")
    args = ap.parse_args()
    if args.profile:
        return profile()
    breakdown = stages(args.n)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(),
                       "stages (256^2 bf16 Block1D row)": breakdown}, f, indent=1)


if __name__ == "__main__":
    main()
