"""fp8blk: FP8 block-scaled quantization for distributed training, in pure Python.

    import fp8blk as fb
    q = fb.quantize(x, fb.Block1D(), rowwise=True, columnwise=True)
    y = q.dequantize()
"""
from .formats import E4M3, E5M2, Block1D, Block2D, Format, MXFP8
from .ops import dequantize, quantize
from .tensor import BlockTensor
from .master import cast_master_weights
from . import comm  # noqa: E402  (fp8blk.comm.* is part of the public API)

__all__ = ["E4M3", "E5M2", "Format", "Block1D", "Block2D", "MXFP8", "BlockTensor", "quantize",
           "dequantize", "comm", "cast_master_weights"]
__version__ = "0.1.0"
