"""CPU checks of the view specs a torch launcher allocates its outputs with
(``fp8blk.kernels.quantize.torch_call``, used by Float8BlockLinear's per-signature plans): a
view must cover exactly the bytes of its docs/layouts.md buffer, densely, and a direction is
viewed iff it is held. The GPU side (the bytes the kernels write through such views) is
tests/torch/linear/test_plans.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8blk as fb  # noqa: E402
from fp8blk._arrays import numpy_to_torch_dtype  # noqa: E402
from fp8blk.kernels import quantize as kq  # noqa: E402
from fp8blk.layout import buffer_layouts  # noqa: E402

F8 = torch.float8_e4m3fn


def outs(recipe, m, k, rowwise=True, columnwise=True):
    """What a launcher allocates by default: (shape, strides, torch dtype) per buffer."""
    return [None if s is None else (s.shape, kq.contiguous_strides(s.shape),
                                    numpy_to_torch_dtype(np.dtype(s.dtype)))
            for s in buffer_layouts(recipe, m, k, rowwise, columnwise)]


def test_the_linear_plans_views_are_accepted():
    m, k = 1024, 512
    views = [((m, k), (k, 1), F8), ((m, k // 128), (1, m), torch.float32),
             ((m, k), (1, m), F8), ((m // 128, k), (k, 1), torch.float32)]
    got = kq._checked_views(outs(fb.Block1D(), m, k), views)
    assert got == [tuple(v) for v in views]
    n = 1536
    wviews = [((k, n), (1, k), F8), ((k // 128, n // 128), (1, k // 128), torch.float32),
              None, None]
    assert kq._checked_views(outs(fb.Block2D(), n, k, True, False), wviews)[0] == wviews[0]


@pytest.mark.parametrize("bad", ["bytes", "overlap", "gap", "held", "not_held"])
def test_views_that_do_not_cover_the_buffer_are_refused(bad):
    m, k = 512, 512
    views = [((m, k), (k, 1), F8), ((m, k // 128), (1, m), torch.float32), None, None]
    if bad == "bytes":
        views[0] = ((m, k), (k, 1), torch.bfloat16)        # twice the bytes
    elif bad == "overlap":
        views[1] = ((m, k // 128), (1, 1), torch.float32)   # rows alias each other
    elif bad == "gap":
        views[0] = ((m // 2, k), (2 * k, 1), F8)            # half the bytes, strided
    elif bad == "held":
        views[1] = None
    else:
        views[2] = ((k, m), (m, 1), F8)
    with pytest.raises(ValueError, match="torch_call"):
        kq._checked_views(outs(fb.Block1D(), m, k, True, False), views)


@pytest.mark.parametrize("m,k,n", [(1002, 640, 384), (1008, 200, 330)])
def test_the_linear_plans_padded_views_are_accepted(m, k, n):
    """Shapes whose scale buffers pad their fast dim to a multiple of 4 (rows, K-blocks or
    features not multiples of 4): the plan's views, from its own helper, cover them exactly."""
    from fp8blk.torch.linear.plans import _scale_t
    from fp8blk.layout import cdiv
    mt, kt, nt, k4 = cdiv(m, 128), cdiv(k, 128), cdiv(n, 128), -(-k // 4) * 4
    xviews = [((m, k), (k, 1), F8), _scale_t(m, kt), ((m, k), (1, m), F8),
              ((mt, k4), (k4, 1), torch.float32)]
    assert kq._checked_views(outs(fb.Block1D(), m, k), xviews) == [tuple(v) for v in xviews]
    wviews = [((k, n), (1, k), F8), _scale_t(kt, nt), None, None]
    assert kq._checked_views(outs(fb.Block2D(), n, k, True, False), wviews)[1] == wviews[1]
    wtviews = [None, None, ((n, k), (1, n), F8), _scale_t(nt, kt)]
    assert kq._checked_views(outs(fb.Block2D(), n, k, False, True), wtviews)[3] == wtviews[3]
    if m % 4:
        with pytest.raises(ValueError, match="torch_call"):   # the unpadded view: refused
                kq._checked_views(outs(fb.Block1D(), m, k, True, False),
                              [xviews[0], ((m, kt), (1, m), torch.float32), None, None])
