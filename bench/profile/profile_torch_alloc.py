"""Host cost of the primitives a torch quantize call is made of: ways to allocate its output
tensors from torch's caching allocator, and the pieces of the raw launch. Prints min / median
microseconds per call of n back-to-back calls.

Last result (H200, 2026-12-01, 256^2 rowwise): the launch (``cuLaunchKernel`` through CuPy's
driver binding) 3.8 us, fp8blk's launch wrapper +0.3-0.8 us, ``torch.empty_strided`` 1.8-2.0 us
per output (``x.new_empty`` 2.3-2.6, ``torch.empty(shape, dtype=, device=)`` 2.9-3.0).

    python3 -m bench.profile.profile_torch_alloc [--n 3000]
"""
from __future__ import annotations

import argparse
import ctypes
import sys

import torch

import fp8blk as fb
from bench.bench_host import host_us
from fp8blk.kernels import _adapters as da
from fp8blk.kernels import quantize as kq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    args = ap.parse_args()
    dev = torch.device("cuda")
    u8, f32 = torch.uint8, torch.float32
    xt = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    tmpl_u8 = torch.empty(1, dtype=u8, device=dev).expand(256, 256)
    tmpl_f32 = torch.empty(1, dtype=f32, device=dev).expand(2, 256)
    real_u8 = torch.empty(256, 256, dtype=u8, device=dev)
    base = torch.empty(1 << 20, dtype=u8, device=dev)
    shape_u8, shape_f32 = (256, 256), (2, 256)
    size_u8 = torch.Size(shape_u8)
    fb.quantize(xt, fb.Block1D())
    fb.quantize(xt, fb.Block1D())
    tc = kq.repeat_calls[(torch.Tensor, fb.Block1D(), torch.bfloat16, xt.shape, True, False,
                          True, 0)]
    outs = [torch.empty(shape_u8, dtype=u8, device=dev),
            torch.empty(shape_f32, dtype=f32, device=dev)]
    largs = [xt.data_ptr(), outs[0].data_ptr(), outs[1].data_ptr(), xt.data_ptr(),
             xt.data_ptr()] + tc.scalars
    driver, runtime = da._cupy_cuda()
    stream = torch._C._cuda_getCurrentRawStream(0)
    params = da._params
    params.slots[:len(largs)] = largs
    kptr = tc.kernel.ptr
    g, b = tc.grid, tc.block
    libcuda = ctypes.CDLL("libcuda.so.1")
    cu_launch = libcuda.cuLaunchKernel
    cu_launch.restype = ctypes.c_int
    cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cases = {
        "x.new_empty u8 (256,256)": lambda: xt.new_empty(shape_u8, dtype=u8),
        "x.new_empty f32 (2,256)": lambda: xt.new_empty(shape_f32, dtype=f32),
        "torch.empty(shape, dtype, device)": lambda: torch.empty(shape_u8, dtype=u8, device=dev),
        "torch.empty(Size, dtype, device)": lambda: torch.empty(size_u8, dtype=u8, device=dev),
        "torch.empty_like(expanded 1-elem template)": lambda: torch.empty_like(tmpl_u8),
        "torch.empty_like(real template)": lambda: torch.empty_like(real_u8),
        "template.new_empty(shape)": lambda: real_u8.new_empty(shape_u8),
        "torch.empty_strided": lambda: torch.empty_strided(shape_u8, (256, 1), dtype=u8,
                                                           device=dev),
        "base[:n] (slice)": lambda: base[:65536],
        "base.view(float32)": lambda: base.view(f32),
        "base.as_strided": lambda: base.as_strided(shape_u8, (256, 1), 512),
        "base.split_with_sizes x4": lambda: base.split_with_sizes([65536, 2048, 65536,
                                                                   1048576 - 133120]),
        "runtime.getDevice()": lambda: runtime.getDevice(),
        "torch._C._cuda_getDevice()": lambda: torch._C._cuda_getDevice(),
        "getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "params.slots[:7] = args": lambda: params.slots.__setitem__(slice(0, 7), largs),
        "x.data_ptr()": lambda: xt.data_ptr(),
        "cupy driver.launchKernel (raw)": lambda: driver.launchKernel(
            kptr, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream, params.address, 0),
        "ctypes cuLaunchKernel (raw)": lambda: cu_launch(
            kptr, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream, params.address, None),
        "da.torch_launch": lambda: da.torch_launch(tc.kernel, g, b, largs, 0),
        "repeat launcher (row)": lambda: tc(xt, xt.data_ptr()),
        "fb.quantize row": lambda: fb.quantize(xt, fb.Block1D()),
        "fb.quantize row+col": lambda: fb.quantize(xt, fb.Block1D(), True, True),
        "torch: x.zero_() on (256,256)": lambda: real_u8.zero_(),
        "torch: x + 1 (256,256) bf16": lambda: xt + 1,
    }
    for name, fn in cases.items():
        lo, med = host_us(fn, args.n)
        print(f"{name:48s} min {lo:6.2f}  median {med:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
