"""The device arrays kernel launchers take, one small adapter per family: CuPy arrays, torch
CUDA tensors, and NumPy arrays under the simulator (CPU tests).

An adapter extends its family's class of :mod:`fp8blk._arrays` (dtype, contiguity, pointer,
device index) with what one launch needs: a new array on the same device, the kernel argument
for an array, and the launch itself on the family's current stream. A launcher is written once for all families, and a torch
tensor never crosses into CuPy (DLPack costs ~24 us per import on the GPU):

* CuPy: CuPy's memory pool and current stream; arrays are passed as themselves (CuPy passes
  the data pointer). bfloat16 data is held as uint16 bit patterns (CuPy has no bf16).
* torch: outputs from torch's caching allocator on the input's device, in the logical dtype
  (torch has bf16), one tensor per buffer (so that a direction dropped later frees its memory);
  the launch goes to torch's current stream of that device (``fp8blk._arrays.torch_raw_stream``).
  The compiled kernels belong to the current CUDA device: a tensor on another device is
  launched inside a device switch.
* NumPy (simulator): pointer arguments are flat NumPy views typed as the kernel indexes them.

On the GPU every kernel argument is 8 bytes (a pointer or an int64), so a torch launch writes
the arguments as ints into a per-thread parameter block and calls ``cuLaunchKernel``
(``cupy.cuda.driver.launchKernel``) with it, on torch's stream handle: no CuPy stream object,
no ``numpy.uint64`` per pointer (~1 us each). The driver copies the parameters during the
call, so the block is reused at once. CuPy arrays go through CuPy's own ``Function`` call.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from .._arrays import (BF16, CupyFamily, HostFamily, TorchFamily, numpy_to_torch_dtype,
                       torch_module, torch_raw_stream)

_U16 = np.dtype(np.uint16)


_MAX_ARGS = 16


class _Params(threading.local):
    """A kernel parameter block of this thread: 16 uint64 slots and the array of their
    addresses that cuLaunchKernel reads."""

    def __init__(self):
        self.slots = (ctypes.c_uint64 * _MAX_ARGS)()
        base = ctypes.addressof(self.slots)
        self.addresses = (ctypes.c_void_p * _MAX_ARGS)(*[base + 8 * i for i in range(_MAX_ARGS)])
        self.address = ctypes.addressof(self.addresses)


_params = _Params()
_cuda = []  # [cupy.cuda.driver, cupy.cuda.runtime], imported on first launch


def _cupy_cuda():
    if not _cuda:
        from cupy.cuda import driver, runtime

        _cuda.extend((driver, runtime))
    return _cuda


def raw_launch(kernel, grid, block, args, stream_ptr):
    """Launch compiled `kernel` (a CuPy Function) with `args`, a list of ints (pointers and
    int64 scalars, each passed as 8 bytes), on the stream `stream_ptr`."""
    driver = (_cuda or _cupy_cuda())[0]
    params = _params
    params.slots[:len(args)] = args
    driver.launchKernel(kernel.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                        0, stream_ptr, params.address, 0)


class _Launches:
    """The launch of CuPy and simulated NumPy kernels alike."""

    @staticmethod
    def launch(kernel, grid, block, args, like):
        # The compiled kernel's own call: on the GPU CuPy's Function (a Cython call converting
        # CuPy arrays to pointers, on CuPy's current stream: as fast as the raw launch and no
        # stream lookup), under the simulator the simulated kernel.
        kernel(grid, block, args)


class _Cupy(_Launches, CupyFamily):
    @staticmethod
    def empty(shape, dtype, like):
        """A new C-contiguous array; bf16 is held as uint16 bit patterns."""
        import cupy

        return cupy.empty(shape, dtype=_U16 if dtype == BF16 else dtype)

    @staticmethod
    def arg(arr, np_dtype):
        return arr.data.ptr

    @staticmethod
    def args(arrays, np_dtypes, scalars):
        """Kernel arguments: the arrays (None: the first array; CuPy passes each array's
        pointer), then `scalars`."""
        first = arrays[0]
        return tuple([first if a is None else a for a in arrays]) + scalars

    @staticmethod
    def alloc(like, nbytes, layouts, offsets):
        """Arrays of `layouts` [(shape, dtype) or None] at byte `offsets` of ONE new allocation
        of `nbytes` (one memory-pool call instead of up to four, a few us each on CuPy)."""
        import cupy

        mem = cupy.cuda.alloc(nbytes)
        # `mem + o` makes a new MemoryPointer (~0.3 us): skip it for the first buffer
        return tuple([None if s is None else cupy.ndarray(s[0], s[1], memptr=mem + o if o else mem)
                      for s, o in zip(layouts, offsets)])



class _Torch(TorchFamily):
    @staticmethod
    def empty(shape, dtype, like):
        return torch_module().empty(shape, dtype=numpy_to_torch_dtype(dtype), device=like.device)

    @staticmethod
    def arg(arr, np_dtype):
        return arr.data_ptr()

    @staticmethod
    def args(arrays, np_dtypes, scalars):
        first = arrays[0].data_ptr()
        return [first if a is None else a.data_ptr() for a in arrays] + list(scalars)

    @staticmethod
    def alloc(like, nbytes, layouts, offsets):
        """One torch tensor per buffer from the caching allocator (its blocks are 512-byte
        aligned), so that a direction dropped later frees its memory (a saved FP8 activation
        must not pin the other direction)."""
        empty, device = torch_module().empty_strided, like.device
        return tuple([None if s is None else empty(s[0], contiguous_strides(s[0]),
                                                   dtype=numpy_to_torch_dtype(s[1]),
                                                   device=device)
                      for s in layouts])

    @staticmethod
    def launch(kernel, grid, block, args, like):
        torch_launch(kernel, grid, block, args, like.get_device())


def torch_launch(kernel, grid, block, args, index):
    """Launch `kernel` with `args` (ints: pointers and int64 scalars) on torch's current stream
    of CUDA device `index` (what ``_Torch.launch`` does; the torch hot paths call it with the
    device index they keyed their plan by)."""
    runtime = (_cuda or _cupy_cuda())[1]
    stream = torch_raw_stream()(index)
    if runtime.getDevice() == index:
        try:
            raw_launch(kernel, grid, block, args, stream)
        except Exception as exc:
            if getattr(exc, "status", None) != _INVALID_CONTEXT:
                raise
            # A thread on which no CUDA runtime call made the device's context current:
            # autograd's worker thread for GPU 0 (torch skips cudaSetDevice when the
            # runtime already reports device 0). setDevice binds the primary context.
            runtime.setDevice(index)
            raw_launch(kernel, grid, block, args, stream)
    else:
        import cupy

        with cupy.cuda.Device(index):
            raw_launch(kernel, grid, block, args, stream)


def contiguous_strides(shape):
    """C-contiguous strides, in elements, of `shape` (a tuple): what ``torch.empty_strided``
    takes, the cheapest of torch's allocating calls from Python."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


class _Sim(_Launches, HostFamily):
    @staticmethod
    def empty(shape, dtype, like):
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def arg(arr, np_dtype):
        return arr.reshape(-1).view(np_dtype)

    @staticmethod
    def args(arrays, np_dtypes, scalars):
        # an output a specialization never touches gets a small array of its pointer type
        # (a view of another array as a wider type fails when its byte size does not divide)
        return tuple([np.zeros(16, t) if a is None else a.reshape(-1).view(t)
                      for a, t in zip(arrays, np_dtypes)]) + tuple(scalars)

    @staticmethod
    def alloc(like, nbytes, layouts, offsets):
        base = np.empty(nbytes, np.uint8)
        return tuple([None if s is None else np.ndarray(s[0], s[1], buffer=base, offset=o)
                      for s, o in zip(layouts, offsets)])



CUPY, TORCH, SIM = _Cupy, _Torch, _Sim
_BY_TYPE = {np.ndarray: _Sim}


def adapter_of(arr):
    """The adapter of an internal device array (CuPy, torch CUDA, or NumPy under the
    simulator)."""
    hit = _BY_TYPE.get(type(arr))
    if hit is not None:
        return hit
    torch = torch_module()
    if torch is not None and isinstance(arr, torch.Tensor):
        if not arr.is_cuda:
            raise TypeError("the kernels take CUDA tensors; CPU tensors use the reference")
        hit = _Torch
    else:
        hit = _Cupy
    if len(_BY_TYPE) < 16:
        _BY_TYPE[type(arr)] = hit
    return hit


__all__ = ["adapter_of", "contiguous_strides", "torch_launch", "CUPY", "TORCH", "SIM"]
