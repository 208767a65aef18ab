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
variant). ``master_batch`` is the master-weight kernels' batch table; ``_specs`` the numba-free
kinds, specs (every setting that changes generated code is a spec field) and launch geometry
both sides share; ``_host`` the launchers' helpers; ``_device`` the device helpers the builders
share. ``_compiled`` gives launchers their kernels: from fp8blk's disk cache (``_cache``;
``FP8BLK_CACHE_DIR``, ``FP8BLK_KERNEL_CACHE=0`` to turn it off; ``python -m fp8blk prebuild``
fills it ahead of time), else compiled once per cache folder. ``_numba`` is the only module
importing numba.cuda, only builders and ``_device`` import ``_numba``, and launchers import
builders only on a cache miss: a process whose kernels are cached never imports numba.

Note: the package attributes ``quantize`` and ``dequantize`` are the functions; the launcher
modules of the same names are ``sys.modules["fp8blk.kernels.quantize"]`` (or ``from
fp8blk.kernels.quantize import NAME``).
"""
from .dequantize import dequantize
from .quantize import quantize
from .transpose import block2d_columnwise_from_rowwise

__all__ = ["quantize", "dequantize", "block2d_columnwise_from_rowwise"]
