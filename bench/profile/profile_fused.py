"""Run the fused row+col quantize kernels once each at 16384x16384 bf16, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:^kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats python3 bench/profile/profile_fused.py
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

x = (cupy.random.standard_normal((16384, 16384), dtype=np.float32).view(np.uint32)
     >> 16).astype(np.uint16)
for recipe in (fb.Block1D(), fb.MXFP8()):  # first launches compile/warm, the next are profiled
    kernels.quantize(x, recipe, True, True, dtype=BF16)
for recipe in (fb.Block1D(), fb.MXFP8()):
    kernels.quantize(x, recipe, True, True, dtype=BF16)
cupy.cuda.Device().synchronize()
