"""The torch dtypes fp8blk's torch adapters name: the float8 dtype of each FP8 format (what
fp8blk's uint8 data bytes are viewed as for a GEMM) and the high-precision dtypes a layer
and a GEMM output take. NumPy <-> torch dtypes: ``fp8blk._arrays.numpy_to_torch_dtype`` /
``torch_to_numpy_dtype``.
"""
from __future__ import annotations

import torch

from ..formats import Format

_FP8_DTYPE = {Format.E4M3: torch.float8_e4m3fn, Format.E5M2: torch.float8_e5m2}

FP8_DTYPES = tuple(_FP8_DTYPE.values())
HIGH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_dtype(fmt: Format):
    """torch.float8_e4m3fn for E4M3, torch.float8_e5m2 for E5M2."""
    return _FP8_DTYPE[fmt]


__all__ = ["fp8_dtype", "FP8_DTYPES", "HIGH_DTYPES"]
