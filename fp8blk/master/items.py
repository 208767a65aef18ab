"""The items of a master-weight batch: :class:`Item` (one weight, validated) and
:func:`validate`, which turns the caller's lists into items or raises TypeError/ValueError
naming the fix."""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ..formats import Block1D, Block2D, MXFP8, check_mxfp8_shape
from ..kernels.partial import BatchWeight
from ..layout import buffer_layouts
from ..tensor import BlockTensor, cupy_buffers

MODEL_DTYPES = (np.dtype(np.float32), _arrays.BF16, np.dtype(np.float16))
_MASTER_DTYPES = (np.dtype(np.float32), _arrays.BF16)


class Item(BatchWeight):
    """One weight of a batch, validated: the kernels' :class:`BatchWeight` of ``weight`` (a
    BlockTensor), whose :meth:`buffers` are read from the weight at each use. ``master`` is the
    internal 1-D array (NumPy or CuPy) or None; ``count`` is its length (0 for None)."""

    def __init__(self, index, weight, h, w, recipe, master, master_dtype, start, count,
                 rowwise, columnwise, frag_row=None, frag_col=None):
        super().__init__(index, h, w, recipe, master, master_dtype, start, count, rowwise,
                         columnwise, None, frag_row, frag_col)
        self.weight = weight

    def buffers(self):
        return cupy_buffers(self.weight)


def _as_list(value, name):
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"{name} must be a list or tuple (one entry per weight), got "
                    f"{type(value).__name__}")


def model_dtype_of(model_dtype):
    try:
        dtype = _arrays.numpy_dtype(model_dtype)
    except TypeError:
        dtype = None
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"model_dtype must be bfloat16, float16 or float32 (NumPy/ml_dtypes, "
                        f"torch or 'bf16'), got {model_dtype!r}")
    return dtype


def _check_buffer(arr, shape, dtype, what, index, on_device):
    if arr is None:
        return
    if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise ValueError(f"weights[{index}] {what} is {arr.dtype}{tuple(arr.shape)}, expected "
                         f"{np.dtype(dtype)}{tuple(shape)} for its shape and recipe (docs/layouts.md)")
    if _arrays.is_device(arr) != on_device:
        raise TypeError(f"weights[{index}] mixes host and device buffers ({what})")
    if not arr.flags.c_contiguous:
        raise ValueError(f"weights[{index}] {what} is not C-contiguous; it must be written in "
                         f"place")
    if not on_device and not arr.flags.writeable:
        raise ValueError(f"weights[{index}] {what} is read-only; it must be written in place")


_BUFFER_NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _check_weight(weight, index, on_device):
    if not isinstance(weight, BlockTensor):
        raise TypeError(f"weights[{index}] must be a fp8blk.BlockTensor, got "
                        f"{type(weight).__name__}")
    recipe = weight.recipe
    if isinstance(recipe, Block1D) or not isinstance(recipe, (Block2D, MXFP8)):
        raise TypeError(f"weights[{index}] has recipe {recipe!r}; cast_master_weights supports "
                        f"Block2D and MXFP8 weights (Block1D's columnwise blocks cross shards "
                        f"and rows; quantize the gathered weight instead)")
    h, w = weight.shape2d
    row_data, row_sinv, col_data, col_sinv = cupy_buffers(weight)
    if (row_data is None) != (row_sinv is None) or (col_data is None) != (col_sinv is None):
        raise ValueError(f"weights[{index}] holds data without scales (or scales without data) "
                         f"in one direction")
    if row_data is None and col_data is None:
        raise ValueError(f"weights[{index}] holds no storage (see BlockTensor.update_usage)")
    check_mxfp8_shape(recipe, h, w, f"weights[{index}]", weight.shape)
    layouts = buffer_layouts(recipe, h, w, True, True)
    for buf, layout, what in zip(cupy_buffers(weight), layouts, _BUFFER_NAMES):
        _check_buffer(buf, layout.shape, layout.dtype, what, index, on_device)
    return h, w


def _internal(x, what, on_device):
    """(internal array, logical dtype) of a caller array `what` (e.g. "masters[3]"); checks the
    host/device side. Errors name `what`."""
    try:
        arr, _, dtype = _arrays.to_backend(x)
    except TypeError as err:
        raise TypeError(f"{what}: {err}") from None
    if _arrays.is_device(arr) != on_device:
        side = "device (CuPy / CUDA torch)" if on_device else "host (NumPy / CPU torch)"
        raise TypeError(f"{what} must be on the same side as the weights' buffers: {side}")
    return arr, np.dtype(dtype)


def _check_master(master, index, h, w, start, on_device):
    dtype = None
    if master is None:
        count = 0
        arr = None
    else:
        arr, dtype = _internal(master, f"masters[{index}]", on_device)
        if arr.ndim != 1:
            raise ValueError(f"masters[{index}] must be a flat (1-D) shard of the row-major "
                             f"weight, got shape {tuple(arr.shape)}: pass master.reshape(-1)")
        if dtype not in _MASTER_DTYPES:
            raise TypeError(f"masters[{index}] must be float32 or bfloat16 (on the GPU, pass bf16 "
                            f"as a torch.bfloat16 tensor), got {dtype}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"masters[{index}] must be contiguous")
        count = int(arr.shape[0])
        if count == 0:
            arr = None
    if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)):
        raise TypeError(f"start_offsets[{index}] must be an int, got {start!r}")
    start = int(start)
    if start < 0 or start + count > h * w:
        raise ValueError(f"masters[{index}] covers flat [{start}, {start + count}), outside the "
                         f"{h}x{w} weight (0..{h * w})")
    return arr, dtype, start, count


def _check_fragment(frag, index, what, count, on_device):
    arr, dtype = _internal(frag, f"fragments[{index}]{what}", on_device)
    if dtype != np.uint8 or arr.ndim != 1 or arr.shape[0] != count:
        raise ValueError(f"fragments[{index}]{what} must be a uint8 array of shape ({count},) "
                         f"(the bytes [o, o+n) of the weight), got {dtype}{tuple(arr.shape)}")
    if not arr.flags.c_contiguous or (not on_device and not arr.flags.writeable):
        raise ValueError(f"fragments[{index}]{what} must be contiguous and writable")
    return arr


def _fragments_for(item, frag, on_device):
    i = item.index
    if isinstance(item.recipe, Block2D):
        if isinstance(frag, (tuple, list)):
            raise TypeError(f"fragments[{i}] is for a Block2D weight: pass one uint8 array of "
                            f"the rowwise bytes [o, o+n), not a pair")
        if frag is None:
            if item.count:
                raise ValueError(f"fragments[{i}] is None but masters[{i}] holds {item.count} "
                                 f"elements")
            return
        if not item.rowwise:
            raise ValueError(f"fragments[{i}] covers rowwise bytes, but weights[{i}] holds no "
                             f"rowwise storage")
        item.frag_row = _check_fragment(frag, i, "", item.count, on_device)
        return
    if frag is None:
        if item.count:
            raise ValueError(f"fragments[{i}] is None but masters[{i}] holds {item.count} "
                             f"elements")
        return
    if not isinstance(frag, (tuple, list)) or len(frag) != 2:
        raise TypeError(f"fragments[{i}] is for an MXFP8 weight: pass a (rowwise, columnwise) "
                        f"pair of uint8 arrays (None for a direction the weight does not hold)")
    for held, part, what, attr in ((item.rowwise, frag[0], "[0] (rowwise)", "frag_row"),
                                   (item.columnwise, frag[1], "[1] (columnwise)", "frag_col")):
        if part is None:
            if held and item.count:
                raise ValueError(f"fragments[{i}]{what} is None but weights[{i}] holds that "
                                 f"direction")
            continue
        if not held:
            raise ValueError(f"fragments[{i}]{what} is given but weights[{i}] does not hold "
                             f"that direction")
        setattr(item, attr, _check_fragment(part, i, what, item.count, on_device))


def validate(weights, masters, start_offsets, fragments):
    """Items of a batch, or TypeError/ValueError naming the fix; returns (items, on_device)."""
    weights = _as_list(weights, "weights")
    masters = _as_list(masters, "masters")
    start_offsets = _as_list(start_offsets, "start_offsets")
    if fragments is not None:
        fragments = _as_list(fragments, "fragments")
    lengths = {"weights": len(weights), "masters": len(masters),
               "start_offsets": len(start_offsets)}
    if fragments is not None:
        lengths["fragments"] = len(fragments)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"one entry per weight is needed in every list; got lengths {lengths}")
    on_device = False
    for i, weight in enumerate(weights):
        if isinstance(weight, BlockTensor):
            some = next((b for b in cupy_buffers(weight) if b is not None), None)
            on_device = _arrays.is_device(some) or _arrays.is_torch(some)
            break
    items = []
    for i, weight in enumerate(weights):
        h, w = _check_weight(weight, i, on_device)
        arr, dtype, start, count = _check_master(masters[i], i, h, w, start_offsets[i],
                                                 on_device)
        item = Item(i, weight, h, w, weight.recipe, arr, dtype, start, count,
                    rowwise=cupy_buffers(weight)[0] is not None,
                    columnwise=cupy_buffers(weight)[2] is not None)
        if fragments is not None:
            _fragments_for(item, fragments[i], on_device)
            if not count:  # an empty fragment has no address to write to
                item.frag_row = item.frag_col = None
        items.append(item)
    return items, on_device


__all__ = ["Item", "validate", "model_dtype_of", "MODEL_DTYPES"]
