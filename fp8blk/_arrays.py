"""Array-family dispatch: NumPy (host), CuPy (device) and torch (either), exchanged through
DLPack without copies.

Internal arrays: NumPy arrays (host), CuPy arrays (device) and, on the operations' hot path
(``to_internal``), torch CUDA tensors as they are: the kernels launch on them by raw pointer on
torch's current stream, so a torch program pays no DLPack crossing per call. bfloat16 is
``ml_dtypes.bfloat16`` on the host; torch bf16 tensors cross DLPack as int16 views (NumPy's
DLPack import has no bf16). FP8 data is always uint8, so no float8 dtype ever crosses a boundary.
This module is the only place that converts between families (``to_backend`` /
``from_backend``: CPU torch <-> NumPy, CUDA torch <-> CuPy, through DLPack without copies).
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
HIGH_PRECISION = (np.dtype(np.float32), BF16, np.dtype(np.float16))

NUMPY, CUPY, TORCH = "numpy", "cupy", "torch"


def torch_module():
    """The torch module if the caller's program has imported it (fp8blk never imports it
    itself). A module still being imported by another thread counts as absent: it may not
    have ``Tensor`` or ``dtype`` yet."""
    torch = sys.modules.get("torch")
    if torch is None or not (hasattr(torch, "dtype") and hasattr(torch, "Tensor")):
        return None
    return torch


def cupy_module():
    """The cupy module if the program has imported it, else None."""
    return sys.modules.get("cupy")


_FAMILY_OF_TYPE = {np.ndarray: NUMPY}  # exact types seen before -> family (one dict lookup)


def family_of(x) -> str:
    """Which array library `x` belongs to; TypeError for anything else."""
    family = _FAMILY_OF_TYPE.get(type(x))
    if family is not None:
        return family
    family = _family_slow(x)
    if len(_FAMILY_OF_TYPE) < 64:
        _FAMILY_OF_TYPE[type(x)] = family
    return family


def _family_slow(x) -> str:
    if isinstance(x, np.ndarray):
        return NUMPY
    cupy = cupy_module()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return CUPY
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH
    raise TypeError(f"expected a numpy.ndarray, cupy.ndarray or torch.Tensor, got "
                    f"{type(x).__module__}.{type(x).__name__}")


def is_torch(x) -> bool:
    """True for a torch tensor (without importing torch)."""
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


_TORCH_TO_NUMPY = {}  # torch dtype -> logical NumPy dtype, filled on first use
_NUMPY_TO_TORCH = {}


def torch_to_numpy_dtype(dtype):
    """Logical NumPy dtype of a torch dtype (bfloat16 -> ml_dtypes.bfloat16), or None."""
    hit = _TORCH_TO_NUMPY.get(dtype)
    if hit is None and not _TORCH_TO_NUMPY:
        _fill_torch_tables()
        hit = _TORCH_TO_NUMPY.get(dtype)
    return hit


def _fill_torch_tables():
    _TORCH_TO_NUMPY.update({k: np.dtype(v) for k, v in _torch_bf16_dtype_map().items()})
    _NUMPY_TO_TORCH.update({v: k for k, v in _TORCH_TO_NUMPY.items()})


def numpy_to_torch_dtype(dtype):
    """torch dtype of a logical NumPy dtype (ml_dtypes.bfloat16 -> torch.bfloat16)."""
    hit = _NUMPY_TO_TORCH.get(dtype)
    if hit is None:
        _fill_torch_tables()
        hit = _NUMPY_TO_TORCH.get(np.dtype(dtype))
        if hit is None:
            raise TypeError(f"no torch dtype for {dtype}")
    return hit


def to_internal(x):
    """``(array, family, logical dtype)`` for the operations (quantize, dequantize): like
    :func:`to_backend`, except that a torch CUDA tensor is returned as it is (the kernels run
    on it natively: torch allocates the outputs, the launch uses torch's current stream).
    Nearly free for a torch CUDA tensor."""
    family = family_of(x)
    if family == TORCH and x.is_cuda:
        dtype = torch_to_numpy_dtype(x.dtype)
        # sparse CUDA tensors would reach the kernels (one identity test, ~40 ns)
        if dtype is None or x.layout is not torch_strided():
            raise TypeError(_torch_rejection(x))
        return x, family, dtype
    return to_backend(x)


_STRIDED = []
_RAW_STREAM = []


def torch_raw_stream():
    """``torch._C._cuda_getCurrentRawStream`` (device index -> the handle of that device's
    current stream; ``torch.cuda.current_stream()`` builds a Stream object, many times slower),
    looked up once. The one place fp8blk reads torch's current stream by handle."""
    if not _RAW_STREAM:
        _RAW_STREAM.append(torch_module()._C._cuda_getCurrentRawStream)
    return _RAW_STREAM[0]


def torch_strided():
    """torch.strided, looked up once."""
    if not _STRIDED:
        _STRIDED.append(torch_module().strided)
    return _STRIDED[0]


def torch_stream_ptr(index=None) -> int:
    """The raw handle of torch's current CUDA stream on device ``index`` (None: the current
    device), without building a Stream object."""
    if index is None:
        index = torch_module().cuda.current_device()
    return torch_raw_stream()(index)


# -- what one array answers, per family: the base that kernels' adapters and the gather's array
# operations extend (they add allocation, views and launches; these four are not restated) --

class HostFamily:
    """NumPy arrays (and what CuPy answers alike, through NumPy's array interface)."""

    name = NUMPY
    device = False  # whether the family's arrays are in device memory

    @staticmethod
    def dtype(arr) -> np.dtype:
        """The array's NumPy dtype (CuPy bf16 data is held as uint16: the logical dtype
        travels beside it)."""
        return arr.dtype

    @staticmethod
    def contiguous(arr) -> bool:
        return arr.flags.c_contiguous

    @staticmethod
    def ptr(arr) -> int:
        """The address of the first element (host or device)."""
        return arr.ctypes.data

    @staticmethod
    def byte_strides(arr) -> tuple:
        """The array's strides in bytes."""
        return tuple(arr.strides)

    @staticmethod
    def device_index(arr):
        """The CUDA device index, or None for host memory."""
        return None


class CupyFamily(HostFamily):
    name = CUPY
    device = True

    @staticmethod
    def ptr(arr) -> int:
        return arr.data.ptr

    @staticmethod
    def device_index(arr):
        return arr.data.device_id


class TorchFamily:
    """torch tensors, CPU or CUDA."""

    name = TORCH

    @staticmethod
    def dtype(arr) -> np.dtype:
        return torch_to_numpy_dtype(arr.dtype)

    @staticmethod
    def contiguous(arr) -> bool:
        return arr.is_contiguous()

    @staticmethod
    def ptr(arr) -> int:
        return arr.data_ptr()

    @staticmethod
    def byte_strides(arr) -> tuple:
        size = arr.element_size()
        return tuple(s * size for s in arr.stride())

    @staticmethod
    def device_index(arr):
        index = arr.get_device()
        return None if index < 0 else index


_FAMILY_CLASS = {NUMPY: HostFamily, CUPY: CupyFamily, TORCH: TorchFamily}


def family_ops(x):
    """The family class of array ``x`` (:class:`HostFamily`, :class:`CupyFamily` or
    :class:`TorchFamily`).

    >>> family_ops(np.zeros(3)).contiguous(np.zeros((4, 4))[:, 1])
    False
    """
    return _FAMILY_CLASS[family_of(x)]


def is_contiguous(x) -> bool:
    """C-contiguity of a NumPy or CuPy array or a torch tensor."""
    return family_ops(x).contiguous(x)


def data_ptr(x) -> int:
    """The address of ``x``'s first element (host or device), any family."""
    return family_ops(x).ptr(x)


def logical_dtype(x) -> np.dtype:
    """The NumPy dtype of an array of any family (torch dtypes mapped: bfloat16 -> BF16)."""
    return family_ops(x).dtype(x)


def _torch_bf16_dtype_map():
    torch = torch_module()
    return {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: BF16,
            torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
            torch.int64: np.int64, torch.float64: np.float64}


_NUMPY_DTYPE = {}  # dtype-like objects seen before -> NumPy dtype (the per-call lookup)


def numpy_dtype(dtype) -> np.dtype:
    """NumPy dtype for a NumPy/ml_dtypes dtype, a type, a string or a torch dtype."""
    try:
        hit = _NUMPY_DTYPE.get(dtype)
    except TypeError:  # unhashable
        hit = None
    if hit is not None:
        return hit
    out = _numpy_dtype_slow(dtype)
    if len(_NUMPY_DTYPE) < 64:
        try:
            _NUMPY_DTYPE[dtype] = out
        except TypeError:
            pass
    return out


def _numpy_dtype_slow(dtype) -> np.dtype:
    torch = torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        mapping = _torch_bf16_dtype_map()
        if dtype not in mapping:
            raise TypeError(f"unsupported torch dtype {dtype}")
        return np.dtype(mapping[dtype])
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return BF16
    return np.dtype(dtype)


def to_backend(x):
    """Return (array, family, dtype): a NumPy array for host data or a CuPy array for device
    data, the caller's family, and the logical NumPy dtype (``BF16`` for bf16, whose device
    buffers are uint16 bit patterns). No copy is made; torch tensors go through DLPack.
    """
    family = family_of(x)
    if family != TORCH:
        return x, family, x.dtype
    torch = torch_module()
    bf16 = x.dtype == torch.bfloat16
    # try costs nothing until it raises (zero-cost exceptions); the message is built then
    try:
        src = x.view(torch.int16) if bf16 else x
        if x.is_cuda:
            import cupy

            arr = cupy.from_dlpack(src.detach())
            return (arr.view(np.uint16) if bf16 else arr), family, (BF16 if bf16 else arr.dtype)
        arr = np.from_dlpack(src.detach())
    except (RuntimeError, BufferError, TypeError, NotImplementedError) as err:
        raise TypeError(_torch_rejection(x)) from err
    return (arr.view(BF16) if bf16 else arr), family, arr.dtype if not bf16 else BF16


def _torch_rejection(x) -> str:
    """Why a CPU torch tensor cannot cross DLPack, naming what is wrong and the fix (error path
    only: these checks cost nothing on the hot path)."""
    if x.is_meta:
        return ("a torch tensor on the meta device holds no data: create it on the CPU or a "
                "CUDA device (e.g. torch.empty(..., device='cuda'))")
    if x.layout != torch_module().strided:
        return (f"a sparse torch tensor (layout {x.layout}) cannot be passed to fp8blk, which "
                f"takes dense strided tensors: pass x.to_dense()")
    if x.is_quantized:
        return (f"a quantized torch tensor ({x.dtype}) cannot be passed to fp8blk: pass "
                f"x.dequantize() (float32), or the float tensor it was made from")
    return (f"torch dtype {x.dtype} cannot be passed to fp8blk; use float32, bfloat16 or "
            f"float16 (e.g. x.float()), or x.view(torch.uint8) for FP8 bytes")


def from_backend(arr, family, dtype=None):
    """Hand an internal (NumPy/CuPy) array back in the caller's family, without copying.

    ``dtype`` is the logical dtype when it differs from ``arr.dtype`` (device bf16 is held as
    uint16 bit patterns).
    """
    if arr is None or family != TORCH or is_torch(arr):  # torch stays torch: no crossing
        return arr
    torch = torch_module()
    bf16 = arr.dtype == BF16 or (dtype is not None and np.dtype(dtype) == BF16)
    if bf16:
        return torch.from_dlpack(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(arr)


def is_device(arr) -> bool:
    """True for CuPy arrays (internal device buffers)."""
    cupy = cupy_module()
    return cupy is not None and isinstance(arr, cupy.ndarray)


def on_gpu(arr) -> bool:
    """True for internal device arrays: CuPy arrays and torch CUDA tensors."""
    return is_device(arr) or (is_torch(arr) and arr.is_cuda)


def as_cupy(arr):
    """A CuPy view of an internal device array (a torch CUDA tensor crosses through DLPack;
    bf16 becomes uint16 bit patterns), for the code that works on CuPy arrays only."""
    if is_torch(arr):
        return to_backend(arr)[0]
    return arr
