"""The device backend ``fp8blk._dispatch`` picks for CuPy arrays and torch CUDA tensors: the
functions of ``fp8blk.reference`` with the same signatures and return conventions, on device
arrays, asynchronous on the array family's current stream:

* ``quantize(x2d, recipe, rowwise, columnwise, dtype=None, out=None)``
* ``dequantize(recipe, shape2d, row_data, row_sinv, col_data, col_sinv, dtype)``
* ``block2d_columnwise_from_rowwise(data, sinv, out=(None, None))``

``dtype`` in quantize is the logical input dtype (CuPy bf16 arrays are uint16 bit patterns).
"""
from .dequantize import dequantize
from .quantize import quantize
from .transpose import block2d_columnwise_from_rowwise

__all__ = ["quantize", "dequantize", "block2d_columnwise_from_rowwise"]
