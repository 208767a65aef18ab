"""GPU dequantize kernels byte for byte against the reference on fresh random data, every path
(``pytest -m gpu tests/kernels``; skipped without CUDA + CuPy)."""
import numpy as np
import pytest

from fp8blk import reference as ref
from fp8blk.kernels import backend as kernels
from tests._same import same_bytes
from tests.kernels._cases import DTYPES, RECIPES, make_input, plant_fp8_specials

pytestmark = pytest.mark.gpu


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
    got = kernels.dequantize(recipe, shape, *dev_bufs, dtype=DTYPES[oname])
    want = ref.dequantize(recipe, shape, *bufs, dtype=DTYPES[oname])
    err = same_bytes(got.get(), want)
    assert err is None, f"{shape} -> {oname}, misaligned={misalign}: {err}"


# (shape, misaligned data). Paths of fp8blk.kernels.dequantize: (M, K) sources take the vector
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
    """Rowwise and columnwise buffers (docs/layouts.md layouts) of uniformly random FP8 bytes (every
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
