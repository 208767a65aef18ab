"""Run the fused row+col quantize kernels once each at 16384x16384 bf16, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:^kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats python3 -m bench.profile.profile_fused
"""
import numpy as np

import cupy

import fp8blk as fb
from fp8blk.kernels import backend as kernels
from fp8blk._arrays import BF16

x = (cupy.random.standard_normal((16384, 16384), dtype=np.float32).view(np.uint32)
     >> 16).astype(np.uint16)
for recipe in (fb.Block1D(), fb.MXFP8()):  # first launches compile/warm, the next are profiled
    kernels.quantize(x, recipe, True, True, dtype=BF16)
for recipe in (fb.Block1D(), fb.MXFP8()):
    kernels.quantize(x, recipe, True, True, dtype=BF16)
cupy.cuda.Device().synchronize()
