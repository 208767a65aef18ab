"""BlockTensor: FP8 bytes plus block scales, in rowwise and/or columnwise layouts."""
from __future__ import annotations

import numpy as np

from . import _arrays
from ._dispatch import backend_for
from .formats import Block2D, as_flag, check_mxfp8_shape, check_recipe
from .layout import BUFFER_NAMES, all_layouts
from .layout import shape2d as _shape2d

_FAMILIES = (_arrays.NUMPY, _arrays.CUPY, _arrays.TORCH)


def internal_buffers(q) -> list:
    """The internal door to a BlockTensor's storage: the list ``[rowwise_data,
    rowwise_scale_inv, columnwise_data, columnwise_scale_inv]`` of internal arrays (None for a
    buffer not held), in place (assigning an entry replaces that buffer). For fp8blk's own
    modules; users read the public properties."""
    return q._buffers


def cupy_buffers(q) -> list:
    """``internal_buffers(q)`` with torch CUDA tensors as CuPy views (the same memory), for
    internal code written for CuPy arrays (the master-weight batch). Each view is made once
    per buffer (a DLPack import is costly on the per-call path) and reused while the buffer is.
    Tensors of another family hold NumPy/CuPy buffers: their list itself comes back (read it,
    don't modify it), at no cost -- the master-weight path calls this per weight, per call."""
    if q._family != _arrays.TORCH:
        return q._buffers
    out = []
    for i, buf in enumerate(q._buffers):
        if buf is None or not _arrays.is_torch(buf):
            out.append(buf)
            continue
        hit = q._exported[i]  # unused for torch-held buffers: they are handed out as they are
        if hit is None or hit[0] is not buf:
            hit = q._exported[i] = (buf, _arrays.as_cupy(buf))
        out.append(hit[1])
    return out


def from_internal(shape, recipe, buffers, dtype, family, cls=None) -> "BlockTensor":
    """The package's trusted constructor (no checks), for fp8blk's own modules that
    made the buffers themselves: ``shape`` a tuple of ints, ``buffers`` the list [row data,
    row scale_inv, col data, col scale_inv] of internal arrays or None, laid out as
    ``fp8blk.layout`` says, ``dtype`` a NumPy dtype, ``family`` one of "numpy", "cupy",
    "torch"; ``cls`` a subclass of BlockTensor to build instead. Users build BlockTensors
    with ``fb.quantize`` or the checked constructor."""
    self = object.__new__(cls or BlockTensor)
    self.shape = shape
    self.recipe = recipe
    self.dtype = dtype
    self._family = family
    self._buffers = buffers
    self._exported = [None, None, None, None]
    return self


class BlockTensor:
    """A block-scaled FP8 tensor of logical shape ``shape`` (..., K), viewed as (M, K).

    Buffers (any may be None when that direction is not held; layouts in docs/layouts.md):
      ``rowwise_data``          uint8 (M, K)
      ``rowwise_scale_inv``     fp32 (Block1D, Block2D) or uint8 E8M0 (MXFP8)
      ``columnwise_data``       uint8 (K, M) for Block1D/Block2D, (M, K) for MXFP8
      ``columnwise_scale_inv``  fp32 or uint8, as above

    Buffers are returned in the array family of the tensor that was quantized (NumPy, CuPy or
    torch), on its device.
    """

    __slots__ = ("shape", "recipe", "dtype", "_family", "_buffers", "_exported")

    def __init__(self, shape, recipe, rowwise_data=None, rowwise_scale_inv=None,
                 columnwise_data=None, columnwise_scale_inv=None, dtype=np.float32,
                 family=None):
        """Wrap existing buffers, checked against the layouts of ``recipe`` and ``shape``
        (``fp8blk.layout``): ``shape`` is a non-empty sequence of ints >= 0, ``recipe`` a
        Block1D/Block2D/MXFP8, each direction holds both its data and its scale_inv or neither,
        and every buffer given has its layout's dtype and shape, is C-contiguous, and all are
        on one side (NumPy/CPU torch, or CuPy/CUDA torch). ``dtype`` is the high-precision
        dtype that was quantized (float32, bfloat16, float16); ``family`` the array library the
        properties hand buffers back in ("numpy", "cupy", "torch"; None: the buffers' own).
        Errors are TypeError/ValueError naming the argument. ``fb.quantize`` builds them for
        you; this is for buffers that come from elsewhere (a checkpoint, another library).

            import numpy as np, fp8blk as fb
            q = fb.quantize(np.ones((4, 256), np.float32), fb.Block1D())
            q2 = fb.BlockTensor((4, 256), fb.Block1D(), q.rowwise_data, q.rowwise_scale_inv)
        """
        shape = _check_shape(shape)
        check_recipe(recipe)
        try:
            np_dtype = _arrays.numpy_dtype(dtype)
        except (TypeError, ValueError):
            np_dtype = None
        if np_dtype not in _arrays.HIGH_PRECISION:
            raise TypeError(f"dtype (the high-precision dtype that was quantized) must be "
                            f"float32, bfloat16 or float16, got {dtype!r}")
        if family is not None and family not in _FAMILIES:
            raise ValueError(f"family must be 'numpy', 'cupy', 'torch' or None, got {family!r}")
        buffers, families = _check_buffers(shape, recipe, (rowwise_data, rowwise_scale_inv,
                                                           columnwise_data, columnwise_scale_inv))
        if family is None:
            family = families[0] if families else _arrays.NUMPY
        elif families:
            device = any(_arrays.on_gpu(b) for b in buffers if b is not None)
            if (family == _arrays.CUPY and not device) or (family == _arrays.NUMPY and device):
                raise ValueError(f"family={family!r} does not match the buffers, which are on "
                                 f"the {'device' if device else 'host'}")
        self.shape = shape
        self.recipe = recipe
        self.dtype = np_dtype
        self._family = family
        self._buffers = buffers
        # torch views of the buffers handed out so far, as (buffer, view) pairs: a DLPack export
        # is costly on the per-call path, so each buffer is exported once, not once per access
        self._exported = [None, None, None, None]

    # -- buffers in the caller's family ------------------------------------------------------
    def _out(self, i):
        buf = self._buffers[i]
        if buf is None or self._family != _arrays.TORCH or _arrays.is_torch(buf):
            return buf
        hit = self._exported[i]
        if hit is None or hit[0] is not buf:  # first access, or the buffer was replaced
            hit = self._exported[i] = (buf, _arrays.from_backend(buf, self._family))
        return hit[1]

    @property
    def rowwise_data(self):
        return self._out(0)

    @property
    def rowwise_scale_inv(self):
        return self._out(1)

    @property
    def columnwise_data(self):
        return self._out(2)

    @property
    def columnwise_scale_inv(self):
        return self._out(3)

    @property
    def shape2d(self):
        """(M, K): the product of the leading dims, and the last dim."""
        return _shape2d(self.shape)

    @property
    def has_rowwise(self) -> bool:
        return self._buffers[0] is not None

    @property
    def has_columnwise(self) -> bool:
        return self._buffers[2] is not None

    def __repr__(self):
        held = [d for d, h in (("rowwise", self.has_rowwise),
                               ("columnwise", self.has_columnwise)) if h]
        return (f"BlockTensor(shape={self.shape}, recipe={self.recipe!r}, "
                f"usage={'+'.join(held) or 'none'}, family={self._family})")

    # -- operations --------------------------------------------------------------------------
    def dequantize(self, dtype=np.float32):
        """High-precision array of logical ``shape`` and `dtype` (float32, float16 or bfloat16;
        NumPy or torch dtypes), from rowwise data if held, else from columnwise data."""
        try:
            out_dtype = _arrays.numpy_dtype(dtype)
        except (TypeError, ValueError):  # e.g. 'nonsense': NumPy's message names no choices
            out_dtype = None
        if out_dtype not in _arrays.HIGH_PRECISION:
            raise TypeError(f"dequantize dtype must be float32, bfloat16 or float16 (NumPy, "
                            f"ml_dtypes or torch dtypes, or 'bfloat16'), got {dtype!r}")
        some = self._buffers[0] if self._buffers[0] is not None else self._buffers[2]
        if some is None:
            raise ValueError("nothing to dequantize: the tensor holds neither rowwise nor "
                             "columnwise data (see update_usage)")
        out = backend_for(some).dequantize(self.recipe, self.shape2d, *self._buffers,
                                           dtype=out_dtype)
        if len(self.shape) != 2:  # a 2-D result is already (M, K): skip the reshape
            out = out.reshape(self.shape)
        return _arrays.from_backend(out, self._family, out_dtype)

    def create_columnwise(self):
        """Block2D only: fill the columnwise buffers by FP8 transpose of the rowwise ones
        (existing columnwise buffers are overwritten in place). Returns self."""
        if not isinstance(self.recipe, Block2D):
            raise ValueError(
                f"create_columnwise needs Block2D data (its columnwise blocks are the transpose "
                f"of its rowwise blocks); {type(self.recipe).__name__} columnwise data uses "
                f"other blocks: quantize with columnwise=True instead")
        if not self.has_rowwise:
            raise ValueError("create_columnwise needs rowwise data, and this tensor holds none")
        backend = backend_for(self._buffers[0])
        col_data, col_sinv = backend.block2d_columnwise_from_rowwise(
            self._buffers[0], self._buffers[1], out=(self._buffers[2], self._buffers[3]))
        self._buffers[2], self._buffers[3] = col_data, col_sinv
        return self

    def update_usage(self, rowwise=None, columnwise=None):
        """Keep or drop each direction. ``False`` frees that direction's buffers; ``True`` makes
        sure they exist (Block2D can derive either from the other by FP8 transpose; other
        recipes raise, since their directions use different blocks). None leaves it as is.
        Flags are bools (``numpy.bool_`` too), as for ``quantize``; anything else (0, 1,
        "False") is a TypeError."""
        if rowwise is not None:
            rowwise = as_flag(rowwise, "rowwise")
        if columnwise is not None:
            columnwise = as_flag(columnwise, "columnwise")
        if columnwise and not self.has_columnwise:
            self.create_columnwise()
        if rowwise and not self.has_rowwise:
            if not isinstance(self.recipe, Block2D) or not self.has_columnwise:
                raise ValueError(
                    f"cannot make rowwise data for this {type(self.recipe).__name__} tensor from "
                    f"what it holds: quantize again with rowwise=True")
            backend = backend_for(self._buffers[2])
            # Block2D rowwise is the transpose of columnwise, the same operation backwards.
            self._buffers[0], self._buffers[1] = backend.block2d_columnwise_from_rowwise(
                self._buffers[2], self._buffers[3], out=(None, None))
        if rowwise is False:
            self._buffers[0] = self._buffers[1] = None
        if columnwise is False:
            self._buffers[2] = self._buffers[3] = None
        return self


def _check_shape(shape) -> tuple:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
        raise TypeError(f"shape must be a tuple of ints (the logical shape (..., K)), got "
                        f"{shape!r}")
    out = []
    for d in shape:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape must be a tuple of ints, got {tuple(shape)!r}")
        if d < 0:
            raise ValueError(f"shape must have dims >= 0, got {tuple(shape)!r}")
        out.append(int(d))
    if not out:
        raise ValueError("shape must have at least one dim (..., K), got ()")
    return tuple(out)


def _check_buffers(shape, recipe, given):
    """Internal arrays of the buffers given, checked against the layouts; and the families
    they came in."""
    rows, cols = _shape2d(shape)
    check_mxfp8_shape(recipe, rows, cols, "the BlockTensor", shape)
    layouts = all_layouts(recipe, rows, cols)
    buffers, families, device = [], [], None
    for buf, layout, name in zip(given, layouts, BUFFER_NAMES):
        if buf is None:
            buffers.append(None)
            continue
        try:  # internal form: NumPy for host data, CuPy as is, torch CUDA tensors as they are
            arr, family, dtype = _arrays.to_internal(buf)
        except TypeError as err:
            raise TypeError(f"{name}: {err}") from None
        if dtype != layout.dtype or tuple(arr.shape) != layout.shape:
            raise ValueError(f"{name} must be {layout.dtype}{layout.shape} for shape {shape} "
                             f"and {recipe!r} (fp8blk.layout.all_layouts), got "
                             f"{dtype}{tuple(arr.shape)}")
        if not _arrays.is_contiguous(arr):
            raise ValueError(f"{name} must be C-contiguous (pass a contiguous copy)")
        on_device = _arrays.on_gpu(arr)
        if device is not None and on_device != device:
            raise ValueError("the buffers must all be on the host (NumPy / CPU torch) or all "
                             "on the device (CuPy / CUDA torch); got a mix")
        device = on_device
        buffers.append(arr)
        families.append(family)
    for d, direction in ((0, "rowwise"), (2, "columnwise")):
        if (buffers[d] is None) != (buffers[d + 1] is None):
            raise ValueError(f"{direction}_data and {direction}_scale_inv must be given together "
                             f"(or both None: that direction is not held)")
    if len(set(families)) > 1:
        raise ValueError(f"the buffers must come from one array library, got {families}")
    return buffers, families
