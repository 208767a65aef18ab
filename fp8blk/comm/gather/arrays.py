"""Array operations of the gather in the caller's own array family (NumPy, CuPy or torch),
so that torch tensors stay torch tensors (torch.empty, views, copy_) and nothing crosses
DLPack per call except where a backend needs it.

``ops_for(arr)`` returns the operations object of an array's family:

``empty(shape, dtype)``            a new C-contiguous array (dtype: a NumPy dtype, BF16 too)
``flat_bytes(arr)``                flat uint8 view of a C-contiguous array
``window(flat, offset, shape, strides, dtype)``
                                   a typed view into a flat uint8 array: ``offset`` in bytes,
                                   ``strides`` in elements of ``dtype`` (the byte offset must
                                   be a multiple of the itemsize)
``copy(dst, src)``, ``fill(dst, value)``   in place, on the current stream
``ptr(arr)``                       the data address (device or host)
``host_view(arr)``                 host arrays: the NumPy array sharing ``arr``'s memory
``device``                         True for CUDA arrays
``current_stream_ptr()``           device: the raw handle of the family's current stream
``copies()``                       device: the raw stream-ordered copies and fills
                                   (:class:`fp8blk.comm.gather.copies.Copies`)

and :func:`local_x2d` gives the local input as the (rows, K) array the quantize takes.
"""
from __future__ import annotations

import sys

import numpy as np

from ... import _arrays
from .copies import cuda_copies

U8 = np.dtype(np.uint8)


def _span(shape, strides):
    """Elements from the first to one past the last element of a strided view."""
    if not all(shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


class NumpyOps(_arrays.HostFamily):
    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def flat_bytes(self, arr):
        return arr.reshape(-1).view(U8)

    def window(self, flat, offset, shape, strides, dtype):
        dtype = np.dtype(dtype)
        item = dtype.itemsize
        return np.ndarray(shape, dtype, buffer=flat, offset=offset,
                          strides=tuple(s * item for s in strides))

    def copy(self, dst, src):
        dst[...] = src

    def fill(self, dst, value):
        dst[...] = value

    def host_view(self, arr):
        return arr

    def nbytes(self, arr):
        return arr.nbytes

    def current_stream_ptr(self):
        return None  # host arrays: no stream


class CupyOps(NumpyOps, _arrays.CupyFamily):
    device = True

    def __init__(self):
        import cupy

        self.cupy = cupy
        self._as_strided = cupy.lib.stride_tricks.as_strided

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        if dtype == _arrays.BF16:
            dtype = np.dtype(np.uint16)  # CuPy holds bf16 as bit patterns
        return self.cupy.empty(shape, dtype)

    def window(self, flat, offset, shape, strides, dtype):
        dtype = np.dtype(dtype)
        if dtype == _arrays.BF16:
            dtype = np.dtype(np.uint16)
        item = dtype.itemsize
        typed = flat[offset: offset + _span(shape, strides) * item].view(dtype)
        return self._as_strided(typed, tuple(shape), tuple(s * item for s in strides))

    def current_stream_ptr(self):
        return self.cupy.cuda.get_current_stream().ptr

    def copies(self):
        return cuda_copies()


class TorchOps(_arrays.TorchFamily):

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device.type == "cuda"
        self.where = device
        self._dtypes = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32,
                        np.dtype(np.float16): torch.float16, _arrays.BF16: torch.bfloat16,
                        np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                        np.dtype(np.float64): torch.float64, np.dtype(np.int16): torch.int16,
                        np.dtype(np.uint16): torch.int16}

    def tdtype(self, dtype):
        return dtype if isinstance(dtype, self.torch.dtype) else self._dtypes[np.dtype(dtype)]

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=self.tdtype(dtype), device=self.where)

    def flat_bytes(self, arr):
        flat = arr.reshape(-1)
        if flat.numel() <= 1 and flat.stride(0) != 1:  # DLPack may give size-0/1 tensors
            flat = flat.as_strided((flat.numel(),), (1,))  # any stride; view() needs 1
        return flat.view(self.torch.uint8)

    def window(self, flat, offset, shape, strides, dtype):
        tdtype = self.tdtype(dtype)
        item = tdtype.itemsize
        typed = flat[offset: offset + _span(shape, strides) * item].view(tdtype)
        return typed.as_strided(tuple(shape), tuple(strides), typed.storage_offset())

    def copy(self, dst, src):
        dst.copy_(src)

    def fill(self, dst, value):
        dst.fill_(value)

    def host_view(self, arr):
        return arr.numpy()  # a CPU tensor's memory

    def nbytes(self, arr):
        return arr.numel() * arr.element_size()

    def current_stream_ptr(self):
        if not self.device:
            return None
        return _arrays.torch_stream_ptr(self.where.index)

    def copies(self):
        return cuda_copies()


_NUMPY = NumpyOps()
_cupy_ops = None
_torch_ops = {}


def internal_ops(device):
    """The operations on internal arrays: CuPy for device data, NumPy for host data."""
    global _cupy_ops
    if not device:
        return _NUMPY
    if _cupy_ops is None:
        _cupy_ops = CupyOps()
    return _cupy_ops


def ops_for(arr):
    """The operations object of ``arr``'s family (NumPy, CuPy, torch on its device)."""
    global _cupy_ops
    if isinstance(arr, np.ndarray):
        return _NUMPY
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(arr, cupy.ndarray):
        if _cupy_ops is None:
            _cupy_ops = CupyOps()
        return _cupy_ops
    device = arr.device
    ops = _torch_ops.get(device)
    if ops is None:
        ops = _torch_ops[device] = TorchOps(device)
    return ops


def local_x2d(x, m, k, rows):
    """The local (rows, K) high-precision array as the quantize backend takes it (``x``: the
    C-contiguous input of m * K elements; rows > m: MXFP8 rowwise pads with zero rows up to a
    multiple of 32, never sent)."""
    if type(x) is not np.ndarray and _arrays.is_torch(x) and not x.is_cuda:
        x = _arrays.to_backend(x)[0]  # a CPU tensor: its NumPy view (no copy)
    x2d = x if x.ndim == 2 else x.reshape(m, k)
    if rows != m:
        if ops_for(x2d).name == _arrays.TORCH:
            padded = x2d.new_zeros((rows, k))
        else:
            padded = (np if isinstance(x2d, np.ndarray) else _arrays.cupy_module()).zeros(
                (rows, k), dtype=x2d.dtype)
        padded[:m] = x2d
        x2d = padded
    return x2d



__all__ = ["local_x2d", "ops_for", "internal_ops",
           "NumpyOps", "CupyOps", "TorchOps"]
