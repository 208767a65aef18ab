"""Run the partial-amax, scale and partial-cast kernels of the master-weight path on a
16384x6144 fp32 shard (Block2D; MXFP8 row-only; MXFP8 bidirectional), twice each, for
Nsight Compute:

    ncu --clock-control none --kernel-name regex:kernel --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 bench/profile/profile_master.py
"""
import os
import sys


# bench/ (for bench_master) and the repository root (this file is bench/profile/NAME.py)
_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _BENCH)
sys.path.insert(0, os.path.dirname(_BENCH))

import cupy as cp  # noqa: E402

import fp8blk as fb  # noqa: E402
from bench_master import H, W, make_weight, masters_for  # noqa: E402
from fp8blk import master  # noqa: E402
from fp8blk.kernels import _specs as dev  # noqa: E402
from fp8blk.kernels import master_batch as mb  # noqa: E402
from fp8blk.kernels import partial_amax as pa  # noqa: E402
from fp8blk.kernels import partial_cast as pc  # noqa: E402

m = masters_for(cp, 1, H * W)
for recipe, col in ((fb.Block2D(fb.E4M3, False), False), (fb.MXFP8(fb.E4M3), False),
                    (fb.MXFP8(fb.E4M3), True)):
    weight = make_weight(cp, recipe, True, col)
    items, _ = master.validate([weight], [m], [0], None)
    batch = mb.Batch(items, have_fragments=False)
    buf = batch.new_buffer()
    for _ in range(2):
        pa.launch_partial_amax(batch, buf, dev.BF16)
        scales = pc.launch_scales(batch, buf, 3.3895313892515355e38)
        pc.launch_cast(batch, scales if batch.block2d else buf, dev.BF16)
cp.cuda.Device().synchronize()
