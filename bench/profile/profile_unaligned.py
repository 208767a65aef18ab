"""Run the kernels that are slow at unaligned shapes, and dequantize, once each, for Nsight
Compute (each is launched twice: the first launch compiles and warms, profile the second):

    ncu --clock-control none --kernel-name regex:kernel --launch-skip-before-match 0 \
        --section SpeedOfLight ... python3 -m bench.profile.profile_unaligned

Cases: Block1D columnwise, Block2D row+col and the Block2D FP8 transpose at 8191x8320 bf16
(transposed (K, M) outputs whose rows are not 16-byte aligned), and dequantize Block1D
rowwise -> bf16 at 16384x16384.
"""
import numpy as np

import cupy

import fp8blk as fb
from fp8blk.kernels import backend as kernels
from fp8blk._arrays import BF16


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
