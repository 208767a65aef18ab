"""GPU Block2D transpose byte for byte against the reference (``pytest -m gpu tests/kernels``;
skipped without CUDA + CuPy)."""
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import reference as ref
from fp8blk.kernels import backend as kernels
from tests._same import same_bytes
from tests.kernels._cases import make_input

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(4096, 4096), (8191, 8320), (129, 141), (1, 1)])
def test_transpose_and_buffer_reuse(rng, shape):
    import cupy

    x = make_input(rng, shape, np.float32)
    data, sinv, _, _ = ref.quantize(x, fb.Block2D(), True, False)
    want = ref.block2d_columnwise_from_rowwise(data, sinv)
    k = kernels
    got = k.block2d_columnwise_from_rowwise(cupy.asarray(data), cupy.asarray(sinv))
    for g, w in zip(got, want):
        assert same_bytes(g.get(), w) is None
    out = (cupy.zeros(want[0].shape, np.uint8), cupy.zeros(want[1].shape, np.float32))
    got2 = k.block2d_columnwise_from_rowwise(cupy.asarray(data), cupy.asarray(sinv), out=out)
    assert got2[0] is out[0] and got2[1] is out[1]
    assert same_bytes(out[0].get(), want[0]) is None and same_bytes(out[1].get(), want[1]) is None
