"""Numba CUDA kernels: the GPU backend of fp8blk for CuPy arrays.

Same functions, signatures and return conventions as ``fp8blk.reference`` (see
``fp8blk._dispatch``), on CuPy arrays, asynchronous on CuPy's current stream:

* ``quantize(x2d, recipe, rowwise, columnwise, dtype=None)``
* ``dequantize(recipe, shape2d, row_data, row_sinv, col_data, col_sinv, dtype)``
* ``block2d_columnwise_from_rowwise(data, sinv, out=(None, None))``

``dtype`` in quantize is the logical input dtype (device bf16 arrays are uint16 bit patterns).

Modules come in pairs named by operation: a launcher (``quantize``, ``dequantize``,
``transpose``, ``partial_amax``, ``partial_cast``: launch plans, allocation, launch) and its
builder (``_quantize_kernel``, ...: the Numba kernel code, compiled on first use per
specialization). ``master_batch`` is the master-weight kernels' batch table; ``_specs`` the
numba-free kinds, specs and launch geometry both sides share; ``_host`` the launchers' helpers;
``_device`` the device helpers the builders share. ``_numba`` is the only module importing
numba.cuda, and only builders and ``_device`` import ``_numba``.

Note: the package attributes ``quantize`` and ``dequantize`` are the functions; the launcher
modules of the same names are ``sys.modules["fp8blk.kernels.quantize"]`` (or ``from
fp8blk.kernels.quantize import NAME``).
"""
from .dequantize import dequantize
from .quantize import quantize
from .transpose import block2d_columnwise_from_rowwise

__all__ = ["quantize", "dequantize", "block2d_columnwise_from_rowwise"]
