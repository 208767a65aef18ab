"""Public operations: ``quantize`` and ``dequantize``. Each validates its input once and hands
internal arrays to the backend (reference on the host, kernels on the GPU)."""
from __future__ import annotations

import sys

import numpy as np

from . import _arrays, reference
from ._dispatch import backend_for
from .formats import as_flag, check_mxfp8_shape, check_recipe
from .layout import shape2d
from .tensor import BlockTensor, from_internal


def _validate(arr, dtype, family, recipe, rowwise, columnwise, contiguous):
    check_recipe(recipe)
    # identity tests first: a plain bool costs two comparisons (np.bool_ and errors go slower)
    if rowwise is not True and rowwise is not False:
        rowwise = as_flag(rowwise, "rowwise")
    if columnwise is not True and columnwise is not False:
        columnwise = as_flag(columnwise, "columnwise")
    if not (rowwise or columnwise):
        raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
    if dtype not in _arrays.HIGH_PRECISION:
        raise TypeError(f"quantize takes float32, bfloat16 or float16 input, got {dtype}: "
                        f"convert it first, e.g. x.astype(numpy.float32) or x.float()")
    if arr.ndim == 0:
        raise ValueError("quantize needs an array with at least one dimension (..., K)")
    if not contiguous:
        fix = "x.contiguous()" if family == _arrays.TORCH else "numpy.ascontiguousarray(x)"
        raise ValueError(f"quantize needs a C-contiguous input (a view of (M, K) without copies); "
                         f"pass {fix}")


def quantize(x, recipe, rowwise: bool = True, columnwise: bool = False) -> BlockTensor:
    """Quantize ``x`` (..., K), float32/bfloat16/float16, NumPy, CuPy or torch, C-contiguous.

    The input is viewed as (M, K) with M the product of the leading dims. Returns a
    :class:`BlockTensor` whose buffers are in x's array family and on x's device. MXFP8 needs
    M and K to be multiples of 32. ``rowwise``/``columnwise`` are bools (``numpy.bool_`` too;
    0/1 or strings are a TypeError). NaN inputs give NaN bytes. +-inf: Block1D and Block2D
    saturate them to +-max; MXFP8 follows Transformer Engine, where a block holding +-inf gets
    amax inf (E8M0 code 254, multiplier 2**-127), so each inf saturates to +-max and the
    block's finite values x become the cast of x * 2**-127 (0 unless huge). Empty inputs give
    correctly shaped empty buffers.

        import numpy as np, fp8blk as fb
        q = fb.quantize(np.random.randn(256, 512).astype(np.float32), fb.Block1D(),
                        rowwise=True, columnwise=True)
        q.rowwise_data.shape, q.columnwise_data.shape   # (256, 512), (512, 256)
    """
    shape, buffers, dtype, family = _quantized(x, recipe, rowwise, columnwise)
    return from_internal(shape, recipe, buffers, dtype, family)


def _quantized(x, recipe, rowwise, columnwise):
    """(shape, the four internal buffers (None where not asked for), logical dtype, family)
    of ``quantize``."""
    # a device call validated before: its launcher, without re-checking. The flags' identity
    # tests: 1 and 1.0 hash like True and must still be refused.
    if _repeat and (rowwise is True or rowwise is False) \
            and (columnwise is True or columnwise is False):
        t = type(x)
        if t is _TORCH_TENSOR:
            if x.is_cuda and x.layout is _STRIDED:
                ptr = x.data_ptr()
                call = _repeat.get((t, recipe, x.dtype, x.shape, rowwise, columnwise,
                                    not ptr & 15, x.get_device()))
                if call is not None and x.is_contiguous():
                    return call.shape, call(x, ptr), call.dtype, _arrays.TORCH
        elif t is _CUPY_ARRAY:
            ptr = x.data.ptr
            call = _repeat.get((t, recipe, x.dtype, x.shape, rowwise, columnwise, not ptr & 15,
                                x.data.device_id))
            if call is not None and x.flags.c_contiguous:
                return call.shape, call(x, ptr), call.dtype, _arrays.CUPY
    arr, family, dtype = _arrays.to_internal(x)
    contiguous = arr.is_contiguous() if family == _arrays.TORCH and arr is x \
        else arr.flags.c_contiguous
    _validate(arr, dtype, family, recipe, rowwise, columnwise, contiguous)
    shape = arr.shape
    rows, cols = shape if len(shape) == 2 else shape2d(shape)
    check_mxfp8_shape(recipe, rows, cols, "x", arr.shape)
    x2d = arr if len(shape) == 2 else arr.reshape(rows, cols)  # skip a no-op reshape on the per-call path
    backend = backend_for(arr)
    buffers = backend.quantize(x2d, recipe, rowwise, columnwise, dtype=dtype)
    if backend is not reference and arr is x and rows and cols:
        _record(x, x2d, recipe, rowwise, columnwise, dtype, family)
    return tuple(shape), list(buffers), dtype, family


# The hot path's table (``fp8blk.kernels.quantize.repeat_calls``, shared) and the exact array
# types it serves, set by the first device call: a process that never touches a GPU never
# imports the kernels.
_repeat = {}
_TORCH_TENSOR = _CUPY_ARRAY = _STRIDED = None


def _record(x, x2d, recipe, rowwise, columnwise, dtype, family):
    """After a validated device quantize of `x` (not a subclass: a tensor subclass may
    override what the hot path reads), keep its launcher for later calls of the same key."""
    global _repeat, _TORCH_TENSOR, _CUPY_ARRAY, _STRIDED
    if family == _arrays.TORCH:
        torch = sys.modules["torch"]
        if type(x) is not torch.Tensor:
            return
        _TORCH_TENSOR, _STRIDED = torch.Tensor, _arrays.torch_strided()
    elif family == _arrays.CUPY:
        import cupy

        if type(x) is not cupy.ndarray:
            return
        _CUPY_ARRAY = cupy.ndarray
    else:
        return
    from .kernels.quantize import record_call, repeat_calls

    record_call(x, x2d, recipe, rowwise, columnwise, dtype)
    _repeat = repeat_calls


def dequantize(q: BlockTensor, dtype=np.float32):
    """``q.dequantize(dtype)``: the high-precision array of q's logical shape."""
    if not isinstance(q, BlockTensor):
        raise TypeError(f"dequantize takes a fp8blk.BlockTensor, got {type(q).__name__}")
    return q.dequantize(dtype)


# -- the package's internal doors (for the gather, FSDP2's cast and the Linear's plans) ------

def quantize_into(x2d, recipe, rowwise, columnwise, dtype, out):
    """Quantize the validated (M, K) array ``x2d`` (internal array or torch tensor, logical
    dtype ``dtype``) into ``out``: four arrays of the exact layouts of
    ``fp8blk.layout.all_layouts``, None for a direction not asked for, written in place; no
    BlockTensor is built.

    The backend is the one ``fp8blk._dispatch.backend_for`` picks: the kernels take CuPy
    arrays and torch CUDA tensors as they are; the reference takes NumPy, so CPU torch tensors
    are handed to it through DLPack (no copy; the results land in ``out``)."""
    backend = backend_for(x2d)
    if backend is reference:
        if _arrays.is_torch(x2d):
            x2d = _arrays.to_backend(x2d)[0]
        out = [_arrays.to_backend(b)[0] if b is not None and _arrays.is_torch(b) else b
               for b in out]
    backend.quantize(x2d, recipe, rowwise, columnwise, dtype=dtype, out=list(out))


def quantize_buffers(x, recipe, rowwise: bool = True, columnwise: bool = False) -> list:
    """``quantize`` without the BlockTensor: its four buffers [rowwise_data, rowwise_scale_inv,
    columnwise_data, columnwise_scale_inv] in x's array family (None for a direction not asked
    for), checked as ``quantize`` checks, for callers that take the buffers apart anyway."""
    shape, buffers, dtype, family = _quantized(x, recipe, rowwise, columnwise)
    return [_arrays.from_backend(b, family) for b in buffers]


def quantize_launcher(x2d, recipe, rowwise, columnwise, views):
    """A reusable launcher ``call(x, ptr) -> [4 tensors]`` for torch CUDA tensors of x2d's
    dtype, 2-D shape, 16-byte alignment and device (the caller checks those per call), whose
    outputs are allocated as ``views[i] = (shape, strides, torch dtype)``: the bytes of buffer
    i of ``fp8blk.layout.all_layouts`` as its consumer reads them (FP8 data as a float8 dtype,
    a scale buffer transposed), None for a direction not asked for."""
    from .kernels.quantize import torch_call

    return torch_call(x2d, recipe, rowwise, columnwise, _arrays.numpy_dtype(x2d.dtype), views)


def quantize_group_site(launchers):
    """One launch site (``fp8blk.kernels._launch.LaunchSite``) doing the work of 2 or 3
    :func:`quantize_launcher` launchers of one device in one kernel launch, byte for byte:
    its ``args`` are each launcher's five pointer slots in turn (input, then its four
    buffers; a buffer not asked for takes any valid pointer), then the scalars (set)."""
    from .kernels.quantize import group_site

    return group_site(launchers)
