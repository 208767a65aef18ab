"""Property tests (hypothesis) and special-value rules of quantize on the host path.

Round-trip bound asserted for every element x of a block whose elements are all finite, with
s the block's cast multiplier (fp32 scale, or E8M0 multiplier 2**(127-c)), scale_inv the stored
factor (fp32 scale_inv, or 2**(c-127)), y = fl32(x*s), d = decode(byte), F = format max and
h(y) = half the FP8 spacing at min(|y|, F): 2**(max(floor(log2|y|), emin) - m - 1), i.e.
2**-10 (E4M3) / 2**-17 (E5M2) throughout the FP8 subnormal range:

* scaled domain, every recipe: |d - y| <= h(y). This includes saturation: |y| can exceed F
  only by fp32 rounding of x*s (< F*2**-23 << h(F)), and such y round to +-F.
* unscaled, on the exact product D = d*scale_inv (dequantize returns fl32(D), checked
  separately), pow2 scales and MXFP8 (s, scale_inv exact powers of two):
  |D - x| <= h(y)*scale_inv + 2**-149*scale_inv   (last term: fp32-subnormal x*s).
* unscaled, non-pow2 fp32 scales: the same plus 2**-20*|x| (fl32 of x*s, and of 1/s -- an fp32
  subnormal when s is FLT_MAX -- each add relative error).
* fl32(D) itself can overflow: x near FLT_MAX (or bf16's max with pow2 scales) rounds up to
  an FP8 value whose D is 2**128, so dequantize to fp32 gives +-inf there. That is the
  specified arithmetic, not a quantization error; the bound is stated on D for that reason.
* MXFP8 E8M0 code 0 (amax*fl32(1/F) <= 2**-127) is no exception: TE's exp2f_rcp gives it the
  multiplier 2**127 and dequantize the factor 2**-127, exact reciprocals like every other code.
"""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8blk as fb
from fp8blk import reference, scaling
from tests import _oracles as O
from tests._same import assert_same_buffers, buffers

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16, np.float16]
FMTS = [fb.E4M3, fb.E5M2]

SPECIALS_FINITE = ["zeros", "neg_zero", "huge", "bf16_max", "subnormal", "tiny_amax", "mixed"]
SPECIALS_NONFINITE = ["nan", "all_nan", "inf", "neg_inf"]


def _apply_special(x, kind, r, c, h, w, dtype, rng):
    sl = (slice(r, r + h), slice(c, c + w))
    shape = x[sl].shape
    big = O.dtype_max(dtype)
    if kind == "zeros":
        x[sl] = 0.0
    elif kind == "neg_zero":
        x[sl] = -0.0
    elif kind == "huge":
        x[sl] = big * rng.uniform(-1, 1, size=shape)
        x[r, c] = big * rng.choice([-1.0, 1.0])
    elif kind == "bf16_max":  # bf16's max is beyond fp16's range: use fp16's max there
        x[r, c] = min(O.BF16_MAX, big) * rng.choice([-1.0, 1.0])
    elif kind == "subnormal":
        x[sl] = O.tiny_value(dtype) * rng.integers(-8, 9, size=shape)
    elif kind == "tiny_amax":  # amax below F / FLT_MAX: F / amax overflows fp32
        x[sl] = 1e-37 * rng.standard_normal(shape)
    elif kind == "mixed":
        x[sl] = rng.standard_normal(shape) * np.exp2(rng.integers(-60, 61, size=shape))
    elif kind == "nan":
        x[r, c] = np.nan
    elif kind == "all_nan":
        x[sl] = np.nan
    elif kind == "inf":
        x[r, c] = np.inf
    elif kind == "neg_inf":
        x[r, c] = -np.inf


@st.composite
def cases(draw, finite=False):
    """(recipe, x): x is (M, K) of fp32/bf16/fp16 with special rectangles applied."""
    family = draw(st.sampled_from(["block1d", "block2d", "mxfp8"]))
    fmt = draw(st.sampled_from(FMTS))
    dtype = draw(st.sampled_from(DTYPES))
    if family == "mxfp8":
        recipe = fb.MXFP8(fmt)
        m, k = 32 * draw(st.integers(1, 3)), 32 * draw(st.integers(1, 5))
    else:
        cls = fb.Block1D if family == "block1d" else fb.Block2D
        recipe = cls(fmt, draw(st.booleans()), draw(st.sampled_from([0.0, 1e-12, 1e-3])))
        m, k = draw(st.integers(1, 200)), draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    span = 10 if dtype == np.float16 else 40
    x = rng.standard_normal((m, k)) * np.exp2(float(draw(st.integers(-span, span))))
    kinds = SPECIALS_FINITE + ([] if finite else SPECIALS_NONFINITE)
    size = st.sampled_from([1, 2, 31, 32, 33, 127, 128, 129, 300])
    for kind, r, c, h, w in draw(st.lists(
            st.tuples(st.sampled_from(kinds), st.integers(0, m - 1), st.integers(0, k - 1),
                      size, size), max_size=5)):
        _apply_special(x, kind, r, c, h, w, dtype, rng)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if np.dtype(dtype) == np.float16:
            x = np.clip(x, -O.FP16_MAX, O.FP16_MAX)
        x = x.astype(np.float32).astype(dtype)
    return recipe, x


PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(cases())
def test_quantize_matches_loop_oracle(case):
    recipe, x = case
    q = fb.quantize(x, recipe, rowwise=True, columnwise=True)
    assert_same_buffers(buffers(q), O.quantize_loop(x, recipe, True, True))
    # NaN inputs give the canonical NaN byte in both directions, never 0xFF
    nan = np.isnan(x.astype(np.float32))
    col = q.columnwise_data if isinstance(recipe, fb.MXFP8) else q.columnwise_data.T
    assert np.all(q.rowwise_data[nan] == 0x7F) and np.all(col[nan] == 0x7F)
    assert not np.any(q.rowwise_data == 0xFF) and not np.any(col == 0xFF)


def check_roundtrip_bound(x, recipe, rowwise):
    m, k = x.shape
    fmt = recipe.fmt
    q = fb.quantize(x, recipe, rowwise=rowwise, columnwise=not rowwise)
    x64 = x.astype(np.float64)
    _, mult = O.block_scales(x, recipe, rowwise)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x64 * mult).astype(np.float32).astype(np.float64)
    if rowwise:
        data, sinv_buf = q.rowwise_data, q.rowwise_scale_inv
    else:
        data = q.columnwise_data if isinstance(recipe, fb.MXFP8) else q.columnwise_data.T
        sinv_buf = q.columnwise_scale_inv
    d = O.fp8_code_values(fmt)[data]
    h = O.fp8_half_ulp(y, fmt)
    assert np.all(np.abs(d - y) <= h), "scaled-domain half-ulp bound violated"

    # dequantize is fl32(d * scale_inv), which the loop oracle computes in float64 and rounds
    deq = q.dequantize(np.float32)
    assert np.array_equal(deq, O.dequantize_loop(recipe, (m, k), buffers(q), rowwise))
    sinv = O.block_factors(recipe, (m, k), sinv_buf, rowwise)
    exact = d * sinv  # exact in float64 (4 x 24 significant bits); deq == fl32(exact)
    exact_scales = isinstance(recipe, fb.MXFP8) or recipe.pow2_scales
    bound = h * sinv + 2.0 ** -149 * sinv
    if not exact_scales:
        bound += 2.0 ** -20 * np.abs(x64)
    err = np.abs(exact - x64)
    bad = err > bound
    assert not bad.any(), [(x64[i], exact[i], bound[i]) for i in zip(*np.nonzero(bad))][:3]


@PROPERTY
@given(cases(finite=True), st.booleans())
def test_roundtrip_within_half_ulp_of_block_scale(case, rowwise):
    recipe, x = case
    check_roundtrip_bound(x, recipe, rowwise)


# --------------------------------------------------------------------------------------------
# The special-value rules of docs/numerics.md, one by one, with hand-computed expectations


def f32(v):
    return np.float32(v)


def test_zero_block_fp32_recipes():
    x = np.zeros((2, 256), dtype=np.float32)
    x[1] = -0.0
    q = fb.quantize(x, fb.Block1D(fb.E4M3, False), columnwise=True)
    assert np.all(q.rowwise_data[0] == 0x00) and np.all(q.rowwise_data[1] == 0x80)
    assert np.all(q.rowwise_scale_inv == 1.0) and np.all(q.columnwise_scale_inv == 1.0)
    # with epsilon the zero amax is raised to epsilon: scale F/eps, scale_inv fl32(1/that)
    q = fb.quantize(x, fb.Block2D(fb.E5M2, False, 1e-12))
    scale = f32(57344.0) / f32(1e-12)
    assert np.all(q.rowwise_scale_inv[0, :2] == f32(1) / scale)  # two 128x128 tiles
    assert np.all(q.rowwise_scale_inv[0, 2:] == 1.0)  # padding
    assert np.all(q.rowwise_data[0] == 0x00) and np.all(q.rowwise_data[1] == 0x80)
    q = fb.quantize(x, fb.Block2D(fb.E4M3, True, 1e-12))  # pow2 floor of 448e12
    assert q.rowwise_scale_inv[0, 0] == 2.0 ** -math.floor(math.log2(448e12))


def test_zero_block_mxfp8():
    x = np.zeros((32, 64), dtype=np.float32)
    x[:, 32:] = -0.0
    q = fb.quantize(x, fb.MXFP8(), columnwise=True)
    assert np.all(q.rowwise_scale_inv == 0) and np.all(q.columnwise_scale_inv == 0)
    assert np.all(q.rowwise_data[:, :32] == 0) and np.all(q.rowwise_data[:, 32:] == 0x80)
    assert np.all(q.columnwise_data == q.rowwise_data)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_nan_inside_block_is_ignored_by_amax(dtype):
    x = np.full((1, 128), 2.0, dtype=np.float32)
    x[0, 5] = 7.0
    x[0, 9] = np.nan
    x = x.astype(dtype)
    q = fb.quantize(x, fb.Block1D(fb.E4M3, False))
    scale = f32(448.0) / f32(7.0)
    assert q.rowwise_scale_inv[0, 0] == f32(1) / scale
    assert q.rowwise_data[0, 9] == 0x7F and q.rowwise_data[0, 5] == 0x7E  # 7*scale -> 448
    xm = np.tile(x[:, :32], (32, 1))
    qm = fb.quantize(xm, fb.MXFP8())
    # v = 7/448 = 2**-6: a power of two, code 121 exactly; multiplier 2**6
    assert np.all(qm.rowwise_scale_inv[:32, 0] == 121)
    assert np.all(qm.rowwise_data[:, 9] == 0x7F) and np.all(qm.rowwise_data[:, 5] == 0x7E)


def test_inf_inside_block():
    x = np.full((32, 32), -3.0, dtype=np.float32)
    x[0, 0], x[0, 1], x[0, 2] = np.inf, -np.inf, np.nan
    q = fb.quantize(x, fb.Block1D(fb.E4M3, False))
    # fp32 recipes: amax inf -> scale 1; +-inf saturate to +-max; -3 -> code of -3
    assert q.rowwise_scale_inv[0, 0] == 1.0
    assert list(q.rowwise_data[0, :3]) == [0x7E, 0xFE, 0x7F]
    assert q.rowwise_data[0, 3] == reference.encode_fp8(f32(-3.0), fb.E4M3)
    assert q.rowwise_scale_inv[0, 1] == f32(1) / (f32(448) / f32(3))  # other rows unaffected
    # MXFP8: amax inf -> code 254 -> cast multiplier 2**-127 (TE's exp2f_rcp): +-inf saturate
    # to +-F, NaN stays NaN, -3 * 2**-127 rounds to -0; dequantize (x 2**127) gives +-inf back
    qm = fb.quantize(x, fb.MXFP8())
    assert qm.rowwise_scale_inv[0, 0] == 254
    assert list(qm.rowwise_data[0, :3]) == [0x7E, 0xFE, 0x7F]
    assert np.all(qm.rowwise_data[0, 3:] == 0x80)
    d = qm.dequantize()
    assert list(d[0, :2]) == [np.inf, -np.inf] and np.isnan(d[0, 2]) and np.all(d[0, 3:] == 0)


def test_all_nan_block():
    """fmaxf from 0: an all-NaN block has amax 0, so scale 1 (or F/eps), E8M0 code 0."""
    x = np.full((32, 128), np.nan, dtype=np.float32)
    x[:, 64:] = 1.0
    q = fb.quantize(x, fb.Block1D(fb.E4M3, False))
    assert np.all(q.rowwise_data[:, :64] == 0x7F) and np.all(q.rowwise_scale_inv[0, :32] != 1.0)
    q = fb.quantize(np.full((3, 100), np.nan, np.float32), fb.Block1D(fb.E4M3, False))
    assert np.all(q.rowwise_scale_inv == 1.0) and np.all(q.rowwise_data == 0x7F)
    q = fb.quantize(np.full((3, 100), np.nan, np.float32), fb.Block1D(fb.E4M3, False, 1e-12))
    assert np.all(q.rowwise_scale_inv[0, :3] == f32(1) / (f32(448) / f32(1e-12)))
    qm = fb.quantize(x, fb.MXFP8(), columnwise=True)
    assert np.all(qm.rowwise_scale_inv[:32, :2] == 0)
    assert np.all(qm.columnwise_scale_inv[0, :64] == 0)
    assert np.all(qm.rowwise_data[:, :64] == 0x7F)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FMTS)
def test_huge_values(dtype, fmt):
    big = O.dtype_max(dtype)
    x = np.full((1, 128), big / 3, dtype=np.float32).astype(dtype)
    x[0, 0] = -big
    q = fb.quantize(x, fb.Block1D(fmt, False))
    scale = f32(fmt.max) / f32(big)
    assert q.rowwise_scale_inv[0, 0] == f32(1) / scale
    max_code = 0x7E if fmt is fb.E4M3 else 0x7B
    assert q.rowwise_data[0, 0] == max_code | 0x80  # -big * F/big rounds to -F
    qp = fb.quantize(x, fb.Block1D(fmt, True))
    assert qp.rowwise_scale_inv[0, 0] == 2.0 ** -math.floor(math.log2(float(scale)))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
def test_subnormal_amax_uses_value_for_inf(dtype):
    x = (np.arange(128, dtype=np.float32) * np.float32(2.0 ** -140)).astype(dtype)
    amax = float(np.abs(x.astype(np.float32)).max())
    assert amax < 2.0 ** -126  # an fp32 subnormal
    big = O.dtype_max(dtype)
    q = fb.quantize(x.reshape(1, 128), fb.Block1D(fb.E4M3, False))
    assert q.rowwise_scale_inv[0, 0] == f32(1) / f32(big)
    want = O.nearest_fp8_code((x.astype(np.float64) * big).astype(np.float32), fb.E4M3)
    assert np.array_equal(q.rowwise_data[0], want)
    assert q.rowwise_data[0, 127] != 0  # the data is not flushed: 127 * 2**-140 * big ~ 0.03
    qp = fb.quantize(x.reshape(1, 128), fb.Block1D(fb.E4M3, True))
    assert qp.rowwise_scale_inv[0, 0] == 2.0 ** -127


def test_fp16_subnormal_amax():
    x = (np.arange(1, 129, dtype=np.float32) * np.float32(2.0 ** -24)).astype(np.float16)
    q = fb.quantize(x.reshape(1, 128), fb.Block1D(fb.E4M3, False))
    assert q.rowwise_scale_inv[0, 0] == f32(1) / (f32(448) / f32(128 * 2.0 ** -24))
    assert q.rowwise_data[0, 127] == 0x7E


# MXFP8 blocks with E8M0 codes 0 and 254, and the bytes TransformerEngine 2.20.2 writes for
# them, derived from its source independently of fp8blk: exp2f_rcp (util/ptx.cuh) gives the
# multiplier 2**127 for code 0 and 2**-127 for code 254; each byte is then the saturating RN
# cast (cvt.rn.satfinite) of fl32(x * multiplier), computed with ml_dtypes (clip to +-F, then
# float8_e4m3fn / float8_e5m2), NaN -> 0x7F. Every value is exact in bf16 too.
CODE0_BLOCK = ([2.0 ** -125, -2.0 ** -125, 1.75 * 2.0 ** -119, 2.0 ** -130, 3 * 2.0 ** -133,
                -5 * 2.0 ** -133, 2.0 ** -133, -0.0, 0.0, math.nan, 1.25 * 2.0 ** -121,
                -1.5 * 2.0 ** -124, 1.375 * 2.0 ** -126]
               + [(k - 22) * 2.0 ** -128 for k in range(13, 32)])
CODE0_BYTES = {
    "E4M3": [0x48, 0xC8, 0x7E, 0x20, 0x14, 0x9A, 0x08, 0x80, 0x00, 0x7F, 0x6A, 0xD4, 0x43,
             0xC9, 0xC8, 0xC6, 0xC4, 0xC2, 0xC0, 0xBC, 0xB8, 0xB0, 0x00, 0x30, 0x38, 0x3C,
             0x40, 0x42, 0x44, 0x46, 0x48, 0x49],
    "E5M2": [0x44, 0xC4, 0x5F, 0x30, 0x2A, 0xAD, 0x24, 0x80, 0x00, 0x7F, 0x55, 0xCA, 0x42,
             0xC4, 0xC4, 0xC3, 0xC2, 0xC1, 0xC0, 0xBE, 0xBC, 0xB8, 0x00, 0x38, 0x3C, 0x3E,
             0x40, 0x41, 0x42, 0x43, 0x44, 0x44],
}
INF_BLOCK = ([math.inf, -math.inf, math.nan, -5.0, 1.0, float(ml_dtypes.finfo(BF16).max),
              -1.5 * 2.0 ** 127, 1.25 * 2.0 ** 120, 2.0 ** 100, -3 * 2.0 ** 113]
             + [(k - 20) * 2.0 ** 124 for k in range(10, 32)])
INF_BYTES = {
    "E4M3": [0x7E, 0xFE, 0x7F, 0x80, 0x00, 0x40, 0xBC, 0x05, 0x00, 0x80, 0xBA, 0xB9, 0xB8,
             0xB6, 0xB4, 0xB2, 0xB0, 0xAC, 0xA8, 0xA0, 0x00, 0x20, 0x28, 0x2C, 0x30, 0x32,
             0x34, 0x36, 0x38, 0x39, 0x3A, 0x3B],
    "E5M2": [0x7B, 0xFB, 0x7F, 0x80, 0x00, 0x40, 0xBE, 0x21, 0x00, 0x8A, 0xBD, 0xBC, 0xBC,
             0xBB, 0xBA, 0xB9, 0xB8, 0xB6, 0xB4, 0xB0, 0x00, 0x30, 0x34, 0x36, 0x38, 0x39,
             0x3A, 0x3B, 0x3C, 0x3C, 0x3D, 0x3E],
}


def check_te_block(block, code, want, fmt, dtype):
    """Quantize a (32, 32) array whose every row is `block` (rowwise) and its transpose
    (columnwise, whose (M, K) data then holds `block` down each column): one E8M0 code `code`
    per block, and TE's bytes `want` in both directions. Dequantize multiplies by the exact
    reciprocal 2**(code - 127). Returns the rowwise BlockTensor."""
    row = np.array(block, dtype=np.float32)
    assert np.array_equal(row.astype(dtype).astype(np.float32), row, equal_nan=True)
    x = np.tile(row, (32, 1)).astype(dtype)
    q = fb.quantize(x, fb.MXFP8(fmt))
    assert np.all(q.rowwise_scale_inv[:32, :1] == code)
    assert np.all(q.rowwise_data == np.array(want, np.uint8)[None, :])
    qc = fb.quantize(np.ascontiguousarray(x.T), fb.MXFP8(fmt), rowwise=False, columnwise=True)
    assert np.all(qc.columnwise_scale_inv[:1, :32] == code)
    assert np.array_equal(qc.columnwise_data, q.rowwise_data.T)
    return q


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_mxfp8_code0_block_te_bytes(fmt, dtype):
    """amax * fl32(1/F) <= 2**-127 -> code 0 -> multiplier 2**127: real bytes, not +-0, and
    dequantize (x 2**-127) returns the FP8 values' own magnitudes."""
    q = check_te_block(CODE0_BLOCK, 0, CODE0_BYTES[fmt.name], fmt, dtype)
    d = q.dequantize(np.float32)[0]
    want = O.fp8_code_values(fmt)[np.array(CODE0_BYTES[fmt.name])] * 2.0 ** -127
    assert np.array_equal(d, want.astype(np.float32), equal_nan=True)
    assert d[0] == 2.0 ** -125 and d[2] == 1.75 * 2.0 ** -119 and np.signbit(d[7])
    # np.full((32, 32), 2**-125) (the whole block 4.0 after scaling)
    qf = fb.quantize(np.full((32, 32), 2.0 ** -125, dtype), fb.MXFP8(fmt))
    assert np.all(qf.rowwise_scale_inv[:32, :1] == 0)
    assert np.all(qf.rowwise_data == (0x48 if fmt is fb.E4M3 else 0x44))


def test_mxfp8_code0_boundary():
    """E4M3 amaxes around v = 2**-127: 448 * 2**-127 and the next fp32 above it still give
    code 0 (v rounds to the fp32 subnormal 2**-127), the second one above gives code 1."""
    top = np.float32(1.75 * 2.0 ** -119)  # 448 * 2**-127
    up = np.nextafter(np.nextafter(top, np.float32(1)), np.float32(1))
    assert scaling.e8m0_from_amax(np.nextafter(top, np.float32(1)), fb.E4M3) == 0
    x = np.tile(np.array([top, up], np.float32).repeat(32), (32, 1))
    q = fb.quantize(x, fb.MXFP8(fb.E4M3))
    assert list(q.rowwise_scale_inv[0, :2]) == [0, 1]
    assert q.rowwise_data[0, 0] == 0x7E           # 448 * 2**-127 * 2**127 = 448
    assert q.rowwise_data[0, 32] == 0x76          # ~448 * 2**-127 * 2**126 = 224


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_mxfp8_inf_block_te_bytes(fmt, dtype):
    """A block holding +-inf -> code 254 -> multiplier 2**-127: +-inf saturate to +-F, NaN
    stays 0x7F, finite x become the cast of fl32(x * 2**-127); dequantize (x 2**127) gives
    +-inf for +-F (beyond fp32) and the values' magnitudes back for the rest."""
    q = check_te_block(INF_BLOCK, 254, INF_BYTES[fmt.name], fmt, dtype)
    d = q.dequantize(np.float32)[0]
    assert list(d[:2]) == [np.inf, -np.inf] and np.isnan(d[2])
    with np.errstate(over="ignore"):
        want = (O.fp8_code_values(fmt)[np.array(INF_BYTES[fmt.name])] * 2.0 ** 127)
        assert np.array_equal(d, want.astype(np.float32), equal_nan=True)
    assert d[6] == -1.5 * 2.0 ** 127
