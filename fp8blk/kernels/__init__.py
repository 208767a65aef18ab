"""Numba CUDA kernels: the GPU backend of fp8blk for CuPy arrays.

Same functions, signatures and return conventions as ``fp8blk.reference`` (see
``fp8blk._dispatch``), on CuPy arrays, asynchronous on CuPy's current stream:

* ``quantize(x2d, recipe, rowwise, columnwise, dtype=None)``
* ``dequantize(recipe, shape2d, row_data, row_sinv, col_data, col_sinv, dtype)``
* ``block2d_columnwise_from_rowwise(data, sinv, out=(None, None))``

Modules: ``quant`` (quantize), ``dequant`` (dequantize), ``transpose``; kernels compile on
first use per specialization. ``dtype`` in quantize is the logical input dtype (device bf16
arrays are uint16 bit patterns).
``_numba`` is the only module importing numba.cuda; ``_host`` and ``_device`` hold the launch
and device helpers other kernel modules reuse.
"""
from .dequant import dequantize
from .quant import quantize
from .transpose import block2d_columnwise_from_rowwise

__all__ = ["quantize", "dequantize", "block2d_columnwise_from_rowwise"]
