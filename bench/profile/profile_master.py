"""Run the partial-amax, scale and partial-cast kernels of the master-weight path on a
16384x6144 fp32 shard (Block2D; MXFP8 row-only; MXFP8 bidirectional), twice each, for
Nsight Compute:

    ncu --clock-control none --kernel-name regex:kernel --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 -m bench.profile.profile_master
"""
import cupy as cp

import fp8blk as fb
from bench.bench_master import H, W, make_weight, masters_for
from fp8blk import master
from fp8blk.kernels import _specs as dev
from fp8blk.kernels import partial

m = masters_for(cp, 1, H * W)
for recipe, col in ((fb.Block2D(fb.E4M3, False), False), (fb.MXFP8(fb.E4M3), False),
                    (fb.MXFP8(fb.E4M3), True)):
    weight = make_weight(cp, recipe, True, col)
    items, _ = master.validate([weight], [m], [0], None)
    batch = partial.Batch(items, have_fragments=False)
    buf = batch.new_buffer()
    for _ in range(2):
        partial.launch_partial_amax(batch, buf, dev.BF16)
        scales = partial.launch_scales(batch, buf, 3.3895313892515355e38)
        partial.launch_cast(batch, scales if batch.block2d else buf, dev.BF16)
cp.cuda.Device().synchronize()
