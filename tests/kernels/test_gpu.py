"""GPU kernels byte for byte against the reference on fresh random data (run on the H200:
``pytest -m gpu tests/kernels/test_gpu.py``; skipped without CUDA + CuPy)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _cases import (BF16, DTYPES, RECIPES, make_input, plant_fp8_specials,  # noqa: E402
                    same_bytes)

import fp8blk as fb  # noqa: E402
from fp8blk import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DIRECTIONS = [(True, False), (False, True), (True, True)]


def _to_device(x):
    import cupy

    return cupy.asarray(x.view(np.uint16) if x.dtype == BF16 else x)


def _kernels():
    from fp8blk import kernels

    return kernels


def _check_quantize(x, recipe, rw, cw):
    got = _kernels().quantize(_to_device(x), recipe, rw, cw, dtype=x.dtype)
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
            got = _kernels().quantize(cupy.zeros(shape, np.float32), recipe, True, True)
            want = ref.quantize(np.zeros(shape, np.float32), recipe, True, True)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype


def _check_dequantize(recipe, shape, bufs, oname, misalign=False):
    """GPU dequantize of host buffers `bufs` against the reference; `misalign` puts the data
    at an odd address (the scalar fallback path)."""
    import cupy

    dev_bufs = [None if b is None else cupy.asarray(b) for b in bufs]
    if misalign:
        for i in (0, 2):
            if dev_bufs[i] is not None:
                raw = cupy.empty(dev_bufs[i].size + 16, np.uint8)
                view = raw[1:1 + dev_bufs[i].size].reshape(dev_bufs[i].shape)
                view[...] = dev_bufs[i]
                dev_bufs[i] = view
    got = _kernels().dequantize(recipe, shape, *dev_bufs, dtype=DTYPES[oname])
    want = ref.dequantize(recipe, shape, *bufs, dtype=DTYPES[oname])
    err = same_bytes(got.get(), want)
    assert err is None, f"{shape} -> {oname}, misaligned={misalign}: {err}"


# (shape, misaligned data). Paths of fp8blk.kernels.dequant: (M, K) sources take the vector
# "rows" kernel when K % E == 0 (E = 4 for fp32, 8 for bf16/fp16 output; 4 for 16-bit outputs
# with K % 8 == 4) and the data is E-aligned; transposed (K, M) sources the "tiles" kernel for
# the same K (16-byte loads when M % 16 == 0 and the data is aligned, else shifted aligned
# chunks); everything else the scalar kernel. 1008 x 1104 has edge tiles in both dims
# (7*128 + 112, 8*128 + 80); 1000 x 1100: 4-element pieces for 16-bit outputs; 1001 x 1096:
# odd M, rows at every alignment; 129 x 141: scalar (K odd); misaligned 999 x 1100: rows
# kernel only for fp32 (4-aligned), tiles at any alignment.
_DQ_SHAPES = [((1000, 1100), False), ((1008, 1104), False), ((1001, 1096), False),
              ((129, 141), False), ((1024, 1024), True), ((999, 1100), True)]
_DQ_SHAPES_MX = [((1056, 1120), False), ((96, 160), False), ((1024, 1056), True)]


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("oname", sorted(DTYPES))
def test_dequantize(rng, rname, columnwise, oname):
    """quantize's buffers of inputs with NaN/inf/zero/tiny blocks, plus every FP8 code and
    E8M0 codes 0/1/254/255 planted (_cases.plant_fp8_specials), through every path."""
    recipe = RECIPES[rname]
    for shape, misalign in (_DQ_SHAPES_MX if rname.startswith("mx") else _DQ_SHAPES):
        x = make_input(rng, shape, np.float32)
        bufs = plant_fp8_specials(rng, ref.quantize(x, recipe, not columnwise, columnwise),
                                  recipe)
        _check_dequantize(recipe, shape, bufs, oname, misalign)


def _random_buffers(rng, recipe, shape):
    """Rowwise and columnwise buffers (DESIGN §4 layouts) of uniformly random FP8 bytes (every
    code, NaN and E5M2 inf included) with a zero 128 x 128 region, random finite scale_inv
    over 2**-40 .. 2**40, or random E8M0 codes 0..255."""
    from fp8blk.layout import buffer_layouts

    out = []
    for (s, dt, _) in buffer_layouts(recipe, *shape, rowwise=True, columnwise=True):
        if dt == np.float32:
            a = (rng.random(s, dtype=np.float32) + np.float32(1)) * np.exp2(
                rng.integers(-40, 41, size=s)).astype(np.float32)
        else:
            a = rng.integers(0, 256, size=s, dtype=np.uint8)
            if a.shape == (shape[0], shape[1]) or a.shape == (shape[1], shape[0]):
                a[128:256, 256:384] = 0
        out.append(a)
    return out


@pytest.mark.parametrize("rname,shape", [
    (r, s) for r in ("b1d", "b2d", "mx", "b1d-e5m2-nopow2", "mx-e5m2")
    for s in ((4096, 4096), (8192, 8192))
] + [(r, s) for r in ("b1d", "b2d", "b1d-e5m2-nopow2")   # transposed rows at any alignment
     for s in ((8191, 8320), (8200, 8196))])                # 8196: 4-element bf16 pieces
def test_dequantize_large(rng, rname, shape):
    """The vector paths at large shapes, rowwise and columnwise, to bf16 and fp32."""
    recipe = RECIPES[rname]
    bufs = _random_buffers(rng, recipe, shape)
    for oname in ("bf16", "f32"):
        _check_dequantize(recipe, shape, bufs[:2] + [None, None], oname)
        _check_dequantize(recipe, shape, [None, None] + bufs[2:], oname)


@pytest.mark.parametrize("shape", [(4096, 4096), (8191, 8320), (129, 141), (1, 1)])
def test_transpose_and_buffer_reuse(rng, shape):
    import cupy

    x = make_input(rng, shape, np.float32)
    data, sinv, _, _ = ref.quantize(x, fb.Block2D(), True, False)
    want = ref.block2d_columnwise_from_rowwise(data, sinv)
    k = _kernels()
    got = k.block2d_columnwise_from_rowwise(cupy.asarray(data), cupy.asarray(sinv))
    for g, w in zip(got, want):
        assert same_bytes(g.get(), w) is None
    out = (cupy.zeros(want[0].shape, np.uint8), cupy.zeros(want[1].shape, np.float32))
    got2 = k.block2d_columnwise_from_rowwise(cupy.asarray(data), cupy.asarray(sinv), out=out)
    assert got2[0] is out[0] and got2[1] is out[1]
    assert same_bytes(out[0].get(), want[0]) is None and same_bytes(out[1].get(), want[1]) is None


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
