"""Run the kernels that are slow at unaligned shapes, and dequantize, once each, for Nsight
Compute (each is launched twice: the first launch compiles and warms, profile the second):

    ncu --clock-control none --kernel-name regex:kernel --launch-skip-before-match 0 \
        --section SpeedOfLight ... python3 bench/profile/profile_unaligned.py

Cases: Block1D columnwise, Block2D row+col and the Block2D FP8 transpose at 8191x8320 bf16
(transposed (K, M) outputs whose rows are not 16-byte aligned), and dequantize Block1D
rowwise -> bf16 at 16384x16384.
"""
import os
import sys

import numpy as np

# the repository root (this file is bench/profile/NAME.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cupy  # noqa: E402

import fp8blk as fb  # noqa: E402
from fp8blk.kernels import backend as kernels  # noqa: E402
from fp8blk._arrays import BF16  # noqa: E402


def bf16(shape):
    return (cupy.random.standard_normal(shape, dtype=np.float32).view(np.uint32)
            >> 16).astype(np.uint16)


xu = bf16((8191, 8320))
xa = bf16((16384, 16384))
b1d, b2d = fb.Block1D(), fb.Block2D()
rd, rs, _, _ = kernels.quantize(xu, b2d, True, False, dtype=BF16)
ad, as_, _, _ = kernels.quantize(xa, b1d, True, False, dtype=BF16)
cupy.cuda.Device().synchronize()
for _ in range(2):
    kernels.quantize(xu, b1d, False, True, dtype=BF16)
    kernels.quantize(xu, b2d, True, True, dtype=BF16)
    kernels.block2d_columnwise_from_rowwise(rd, rs)
    kernels.dequantize(b1d, (16384, 16384), ad, as_, None, None, dtype=BF16)
cupy.cuda.Device().synchronize()
