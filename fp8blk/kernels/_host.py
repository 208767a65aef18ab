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
from . import _specs as sp
from ._sim import SIM

_KIND_OF = {np.dtype(np.float32): sp.F32, np.dtype(np.float16): sp.F16}


def kind_of(arr, dtype):
    """Input kind (sp.F32 / BF16 / F16) from the logical dtype (device bf16 is uint16)."""
    logical = np.dtype(dtype) if dtype is not None else arr.dtype
    if logical == BF16:
        return sp.BF16
    kind = _KIND_OF.get(logical)
    if kind is None:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 input, got {logical}")
    if arr.dtype.itemsize != sp.ITEMSIZE[kind]:
        raise TypeError(f"array of dtype {arr.dtype} does not hold {logical} elements")
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


def unused_pointer(like):
    """A pointer argument for an output a specialization never touches."""
    if SIM:
        return np.zeros(16, dtype=np.uint8)
    return like


def alloc_views(xp, nbytes, shapes, offsets):
    """Arrays of `shapes` [((shape), dtype) or None] at byte `offsets` of ONE new allocation of
    `nbytes`: one memory-pool call instead of up to four (a few microseconds each on CuPy)."""
    if xp is np:
        base = np.empty(nbytes, np.uint8)
        return tuple([None if s is None else np.ndarray(s[0], s[1], buffer=base, offset=o)
                      for s, o in zip(shapes, offsets)])
    mem = xp.cuda.alloc(nbytes)
    # `mem + o` makes a new MemoryPointer (~0.3 us): skip it for the first buffer
    return tuple([None if s is None else xp.ndarray(s[0], s[1], memptr=mem + o if o else mem)
                  for s, o in zip(shapes, offsets)])


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


def i64(v):
    return np.int64(v)
