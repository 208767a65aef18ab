"""GPU quantize kernels byte for byte against the reference on fresh random data (run on the
H200: ``pytest -m gpu tests/kernels``; skipped without CUDA + CuPy)."""
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import reference as ref
from fp8blk.kernels import backend as kernels
from tests._same import same_bytes
from tests.kernels._cases import BF16, DTYPES, RECIPES, make_input

pytestmark = pytest.mark.gpu

DIRECTIONS = [(True, False), (False, True), (True, True)]


def _to_device(x):
    import cupy

    return cupy.asarray(x.view(np.uint16) if x.dtype == BF16 else x)


def _check_quantize(x, recipe, rw, cw):
    got = kernels.quantize(_to_device(x), recipe, rw, cw, dtype=x.dtype)
    want = ref.quantize(x, recipe, rw, cw)
    errs = [same_bytes(None if g is None else g.get(), w) for g, w in zip(got, want)]
    errs = [f"buffer {i}: {e}" for i, e in enumerate(errs) if e]
    assert not errs, "; ".join(errs)


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("dname", sorted(DTYPES))
@pytest.mark.parametrize("rw,cw", DIRECTIONS)
def test_quantize_medium_all_variants(rng, rname, dname, rw, cw):
    shape = (1056, 1120) if rname.startswith("mx") else (1000, 1100)
    _check_quantize(make_input(rng, shape, DTYPES[dname]), RECIPES[rname], rw, cw)


@pytest.mark.parametrize("rname", ["b1d", "b2d", "mx", "b1d-e5m2-nopow2", "b2d-e5m2-nopow2"])
@pytest.mark.parametrize("shape", [(4096, 4096), (8191, 8320)])
def test_quantize_large(rng, rname, shape):
    if rname.startswith("mx"):
        shape = (shape[0] + 1, shape[1]) if shape[0] % 2 else shape
    _check_quantize(make_input(rng, shape, BF16), RECIPES[rname], True, True)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (17, 129), (129, 17), (2, 128)])
@pytest.mark.parametrize("rname", ["b1d", "b2d"])
def test_quantize_tiny_and_unaligned(rng, rname, shape):
    for dname in DTYPES:
        _check_quantize(make_input(rng, shape, DTYPES[dname]), RECIPES[rname], True, True)


def test_quantize_empty():
    import cupy

    for recipe in (fb.Block1D(), fb.Block2D(), fb.MXFP8()):
        for shape in ((0, 64), (64, 0)):
            got = kernels.quantize(cupy.zeros(shape, np.float32), recipe, True, True)
            want = ref.quantize(np.zeros(shape, np.float32), recipe, True, True)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype


def test_families_and_3d_input(rng):
    """numpy -> numpy, cupy -> cupy, torch CUDA (bf16, 3-D) -> torch, equal bytes."""
    import cupy

    x = make_input(rng, (4, 96, 256), np.float32)
    q_np = fb.quantize(x, fb.Block1D(), rowwise=True, columnwise=True)
    q_cp = fb.quantize(cupy.asarray(x), fb.Block1D(), rowwise=True, columnwise=True)
    assert isinstance(q_np.rowwise_data, np.ndarray)
    assert isinstance(q_cp.rowwise_data, cupy.ndarray)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert same_bytes(getattr(q_cp, name).get(), getattr(q_np, name)) is None, name
    torch = pytest.importorskip("torch")
    xb = make_input(rng, (2, 64, 384), BF16)
    t = torch.from_numpy(xb.view(np.int16)).view(torch.bfloat16).cuda()
    for recipe in (fb.Block1D(), fb.Block2D(), fb.MXFP8()):
        q_t = fb.quantize(t, recipe, rowwise=True, columnwise=True)
        q_h = fb.quantize(xb, recipe, rowwise=True, columnwise=True)
        assert isinstance(q_t.rowwise_data, torch.Tensor) and q_t.rowwise_data.is_cuda
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                     "columnwise_scale_inv"):
            got = getattr(q_t, name).cpu().numpy()
            assert same_bytes(got, getattr(q_h, name)) is None, (recipe, name)
        y_t = q_t.dequantize(torch.bfloat16)
        assert y_t.dtype == torch.bfloat16 and y_t.shape == t.shape
        y_h = q_h.dequantize(BF16)
        assert same_bytes(y_t.view(torch.int16).cpu().numpy(), y_h.view(np.int16)) is None
    q2 = fb.quantize(t, fb.Block2D(), rowwise=True).create_columnwise()
    q2h = fb.quantize(xb, fb.Block2D(), rowwise=True).create_columnwise()
    assert same_bytes(q2.columnwise_data.cpu().numpy(), q2h.columnwise_data) is None


def test_negative_nan_gives_reference_byte(rng):
    """-NaN and NaN payloads must give the reference's 0x7F for both formats."""
    nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0xFF800001],
                        dtype=np.uint32).view(np.float32)
    x = make_input(rng, (256, 256), np.float32)
    x[5, :5] = nan_bits
    x[:5, 7] = nan_bits
    for recipe in (fb.Block1D(), fb.Block1D(fmt=fb.E5M2), fb.Block2D(fmt=fb.E5M2), fb.MXFP8(),
                   fb.MXFP8(fmt=fb.E5M2)):
        _check_quantize(x, recipe, True, True)


@pytest.mark.parametrize("dname", ["bf16", "f16"])
@pytest.mark.parametrize("rname", ["b1d", "b1d-e5m2-nopow2", "mx", "mx-e5m2"])
@pytest.mark.parametrize("rw,cw", DIRECTIONS)
def test_packed_amax_special_halves(rng, dname, rname, rw, cw):
    """2-byte inputs take packed (2 x 16-bit) abs-max paths: NaN / -NaN in one half of a word,
    subnormal-only, -0-only and -inf blocks, negative maxima, in row and in column blocks."""
    dtype = DTYPES[dname]
    x = make_input(rng, (1024, 1024), dtype)
    bits = x.view(np.uint16)
    expo = 0x80 if dname == "bf16" else 0x400            # first normal exponent bit
    nan, neg_inf, neg_max = (0x7FC1, 0xFF80, 0xFF7F) if dname == "bf16" else \
        (0x7E01, 0xFC00, 0xFBFF)
    sub = rng.integers(1, expo, size=1024).astype(np.uint16) | \
        (rng.integers(0, 2, size=1024).astype(np.uint16) << 15)
    bits[5, :] = sub                      # subnormal-only row blocks
    bits[:, 9] = sub                      # subnormal-only column blocks
    bits[6, 0::2] = nan                   # NaN in every low half
    bits[7, 1::2] = nan | 0x8000          # -NaN in every high half
    bits[0::2, 13] = nan                  # NaN in every other row of a column
    bits[8, :] = 0x8000                   # -0 row
    bits[8, 3] = neg_inf                  # -inf in a block of -0
    bits[40:72, 11] = nan | 0x8000        # a 32x1 column block of NaN
    bits[10, 64:96] = neg_max             # negative maxima
    bits[200:328, 17] = neg_max
    _check_quantize(x, RECIPES[rname], rw, cw)


def test_settings_through_the_tuning_door(rng):
    """``quantize.use_settings`` with a ``backend.QuantizeSettings``: the kernels looked up
    afterwards carry the settings in their specs, the bytes do not change, and
    ``loaded_kernels`` lists them."""
    from fp8blk.kernels import quantize as kq
    from fp8blk.kernels.backend import QuantizeSettings

    x = make_input(rng, (1000, 1100), DTYPES["bf16"])
    saved = kq.use_settings(QuantizeSettings(min_blocks_per_sm=2))
    try:
        assert kq.loaded_kernels() == []
        _check_quantize(x, RECIPES["b1d"], True, True)
        specs = [spec for _, spec in kq.loaded_kernels()]
        assert specs and all(spec.min_blocks == 2 for spec in specs), specs
    finally:
        kq.use_settings(saved)


# A Linear's groups (fp8blk/torch/linear/plans.py): forward x (1x128 rowwise [+ columnwise])
# and W (128x128 rowwise); backward dY (1x128 both ways), W (128x128 columnwise) and a
# keep_input layer's x (1x128 columnwise). Shapes (M, K, N): aligned, unaligned everywhere,
# a part of one block, parts of very different CTA counts.
GROUP_SHAPES = [(1024, 1024, 1536), (1000, 1100, 272), (8191, 640, 4100), (3, 17, 129),
                (4096, 128, 16)]


def _group_parts(rng, m, k, n, dname, keep, backward):
    dt = DTYPES[dname]
    x, w = make_input(rng, (m, k), dt), make_input(rng, (n, k), dt)
    if backward:
        parts = [(make_input(rng, (m, n), dt), RECIPES["b1d-e5m2-nopow2"], True, True),
                 (w, RECIPES["b2d"], False, True)]
        return parts + ([(x, RECIPES["b1d"], False, True)] if keep else [])
    return [(x, RECIPES["b1d"], True, not keep), (w, RECIPES["b2d"], True, False)]


@pytest.mark.parametrize("m,k,n", GROUP_SHAPES)
@pytest.mark.parametrize("dname", ["bf16", "f32", "f16"])
@pytest.mark.parametrize("keep", [False, True], ids=["saved", "keep_input"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_quantize_group_equals_separate_launches(rng, m, k, n, dname, keep, backward):
    """One group launch gives each part the bytes of its own quantize launch (and of the
    reference), data spanning orders of magnitude with NaN, inf and zero blocks."""
    from fp8blk.kernels.quantize import quantize_group

    parts = _group_parts(rng, m, k, n, dname, keep, backward)
    dev = [(_to_device(x), r, rw, cw, x.dtype) for x, r, rw, cw in parts]
    got = quantize_group(dev)
    host = lambda bufs: [None if b is None else b.get() for b in bufs]  # noqa: E731
    errs = []
    for p, ((x, r, rw, cw), (xd, *_), bufs) in enumerate(zip(parts, dev, got)):
        alone = host(kernels.quantize(xd, r, rw, cw, dtype=x.dtype))
        for i, (g, a, w) in enumerate(zip(host(bufs), alone, ref.quantize(x, r, rw, cw))):
            e = same_bytes(g, a) or same_bytes(a, w)
            if e:
                errs.append(f"part {p} buffer {i}: {e}")
    assert not errs, "; ".join(errs)


def test_quantize_group_threads_of_other_settings(rng):
    """Parts whose own kernels run at different CTA sizes (a 512-thread setting) run at 256 in
    the group, with the same bytes."""
    from fp8blk.kernels import quantize as kq

    prev = kq.use_settings(kernels.QuantizeSettings(fused_block1d_threads=512))
    try:
        parts = _group_parts(rng, 1000, 1100, 272, "bf16", True, True)
        dev = [(_to_device(x), r, rw, cw, x.dtype) for x, r, rw, cw in parts]
        for (x, r, rw, cw), bufs in zip(parts, kq.quantize_group(dev)):
            errs = [same_bytes(None if g is None else g.get(), w)
                    for g, w in zip(bufs, ref.quantize(x, r, rw, cw))]
            assert not any(errs), errs
    finally:
        kq.use_settings(prev)
