"""Host-side helpers shared by the kernels' Python entry points: array module, allocation,
pointer arguments, launch.

On the GPU the arrays are CuPy arrays and kernels are CuPy ``Function`` objects taking CuPy
arrays (passed as data pointers) and ``numpy.int64`` scalars, launched on CuPy's current
stream without synchronizing. Under the simulator (CPU tests) the same entry points take NumPy
arrays, and pointer arguments become flat NumPy views of the element type the kernel indexes.
"""
from __future__ import annotations

import numpy as np

from .._arrays import BF16
from ..layout import cdiv, round_up  # noqa: F401  (re-exported for the launchers)
from . import _device as dev
from ._numba import SIM

_KIND_OF = {np.dtype(np.float32): dev.F32, np.dtype(np.float16): dev.F16}


_KINDS = {}  # (stored dtype, logical dtype) -> kind: the per-call lookup


def kind_of(stored, dtype):
    """Input kind (dev.F32 / BF16 / F16) from the logical dtype `dtype` (None: the stored one)
    and the array's stored dtype `stored` (CuPy holds bf16 as uint16)."""
    kind = _KINDS.get((stored, dtype))
    if kind is None:
        kind = _KINDS[(stored, dtype)] = _kind_slow(stored, dtype)
    return kind


def _kind_slow(stored, dtype):
    logical = np.dtype(dtype) if dtype is not None else stored
    if logical == BF16:
        kind = dev.BF16
    else:
        kind = _KIND_OF.get(logical)
        if kind is None:
            raise TypeError(f"quantize takes float32, bfloat16 or float16 input, got {logical}")
    if stored.itemsize != dev.ITEMSIZE[kind]:
        raise TypeError(f"array of dtype {stored} does not hold {logical} elements")
    return kind


def module_of(arr):
    """numpy or cupy, whichever `arr` belongs to."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def data_ptr(arr) -> int:
    return arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr


def pointer_arg(arr, np_dtype):
    """Kernel pointer argument for `arr`: the array itself on the GPU (CuPy passes its data
    pointer); under the simulator a flat view typed as the kernel indexes it."""
    if SIM:
        return arr.reshape(-1).view(np_dtype)
    return arr


def cached_plan(cache, key, build):
    """``cache[key]``, built with ``build(*key)`` on a miss: the per-call lookup of the
    kernels' launch plans. The cache is emptied when it passes 4096 entries (a program that
    cycles through that many shapes pays a rebuild, never unbounded memory)."""
    plan = cache.get(key)
    if plan is None:
        if len(cache) > 4096:
            cache.clear()
        plan = cache[key] = build(*key)
    return plan


def pointer_dtypes(argtypes):
    """NumPy element dtypes of the raw-pointer kernel argument types in `argtypes` (the
    simulator's flat views of the pointer arguments need them)."""
    return tuple(np.dtype(t.dtype.name) for t in argtypes)


def i64(v):
    """A kernel's int64 scalar argument (a NumPy int64: the simulator needs the type; the raw
    launch on the GPU writes it as 8 bytes)."""
    return np.int64(v)
