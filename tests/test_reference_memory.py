"""The CPU reference's time and memory scale with the input: edge blocks are not padded.

A (1, 4194304) fp32 input (16 MiB) is one row of 128x1 column blocks and of 128x128 tiles that
are 127/128 padding; quantizing it (and its transpose) must take a few times the input's
memory, not 128 times. Peak memory is measured with tracemalloc (NumPy reports its buffers to
it); time is the process's CPU time, which other processes on a loaded machine do not inflate.
"""
import time
import tracemalloc

import numpy as np
import pytest

import fp8blk as fb

GIB = 2 ** 30
LONG = 4194304  # 16 MiB of fp32

CASES = [
    ((1, LONG), fb.Block1D(fb.E4M3)),
    ((LONG, 1), fb.Block1D(fb.E4M3)),
    ((1, LONG), fb.Block2D(fb.E4M3)),
    ((LONG, 1), fb.Block2D(fb.E4M3)),
    ((3, LONG // 3 + 1), fb.Block2D(fb.E5M2)),
    # MXFP8 needs both dimensions to be multiples of 32.
    ((32, LONG // 32), fb.MXFP8(fb.E4M3)),
]


def measured(fn):
    """(result, CPU seconds, peak bytes allocated while it ran)."""
    tracemalloc.start()
    try:
        start = time.process_time()
        result = fn()
        seconds = time.process_time() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, seconds, peak


@pytest.mark.parametrize("shape, recipe", CASES, ids=lambda v: str(v))
def test_long_thin_input_quantizes_in_proportion(shape, recipe):
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    q, seconds, peak = measured(lambda: fb.quantize(x, recipe, rowwise=True, columnwise=True))
    # ~0.2 s and ~100 MiB on one core; a padded reference took 13-21 s and 12 GiB.
    assert peak < 0.5 * GIB, f"peak {peak / 2**20:.0f} MiB for a {x.nbytes / 2**20:.0f} MiB input"
    assert seconds < 2.0, f"{seconds:.2f} s of CPU"
    back, seconds, peak = measured(lambda: q.dequantize(np.float32))
    assert peak < 0.5 * GIB and seconds < 2.0, (peak, seconds)
    # The values survive: FP8 (2 or 3 mantissa bits) rounds within 1/8 of a block amax.
    row_amax = np.abs(x).max()
    assert np.abs(back - x).max() <= 0.125 * row_amax
