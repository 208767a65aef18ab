"""FP8 encode/decode of fp8blk.reference against independent oracles.

encode_fp8 is checked on every bf16 bit pattern (widened to fp32) times several fp32 scales,
for E4M3 and E5M2, against ``_oracles.nearest_fp8_code`` (the nearest of the decoded codes,
ties to the even code, saturating at +-max, NaN -> 0x7F, sign of zero kept), and against the
ml_dtypes and torch float8 casts on the values where those casts are defined the same way
(|v| <= max, not NaN: they do not saturate).
"""
import math

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import reference
from tests import _oracles as O

FMTS = [fb.E4M3, fb.E5M2]
ML_DTYPE = {fb.E4M3: ml_dtypes.float8_e4m3fn, fb.E5M2: ml_dtypes.float8_e5m2}

# Powers of two move the bf16 grid across the FP8 range (saturation, subnormals, underflow to 0);
# the others make products that are not FP8 grid points or midpoints, and FLT_MAX/2**126 make
# finite products overflow to inf.
SCALES = [1.0, 2.0 ** -9, 2.0 ** -16, 2.0 ** -24, 2.0 ** 10, 2.0 ** 20, 2.0 ** 100, 2.0 ** -100,
          2.0 ** 126, 3.0, 0.1, 448.0 / 3.0, 1.0 + 2.0 ** -23, 1.0 - 2.0 ** -24, 57344.0 / 7.0,
          1e-38, O.FLT_MAX]


def all_bf16_as_fp32():
    """All 65536 bf16 bit patterns widened to fp32 (incl. +-0, +-inf, NaNs, subnormals)."""
    return (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)


def scaled_bf16_products():
    x = all_bf16_as_fp32()
    with np.errstate(over="ignore", invalid="ignore"):
        return np.concatenate([x * np.float32(s) for s in SCALES])


def show(values, got, want, limit=8):
    bad = np.nonzero(got != want)[0][:limit]
    return [(float(values[i]), hex(int(got[i])), hex(int(want[i]))) for i in bad]


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_every_bf16_times_scales_matches_oracle(fmt):
    v = scaled_bf16_products()
    got = reference.encode_fp8(v, fmt)
    want = O.nearest_fp8_code(v, fmt)
    assert got.dtype == np.uint8 and got.shape == v.shape
    assert np.array_equal(got, want), show(v, got, want)
    # the test data really covers every case it claims to
    mag = np.abs(v)
    assert np.isnan(v).any() and np.isposinf(v).any() and np.isneginf(v).any()
    assert (mag > fmt.max).any()                                       # saturation
    assert ((mag > 0) & (mag < 2.0 ** fmt.min_normal_exponent)).any()  # FP8 subnormals
    assert (np.signbit(v) & (got == 0x80)).any()                       # negative zero results


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_random_fp32_patterns_match_oracle(fmt, rng):
    v = rng.integers(0, 1 << 32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = reference.encode_fp8(v, fmt)
    want = O.nearest_fp8_code(v, fmt)
    assert np.array_equal(got, want), show(v, got, want)


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_exact_ties_round_to_even(fmt):
    """Every midpoint between neighbouring finite FP8 values (both signs, subnormal and normal),
    and the midpoint just above max (which still rounds to max)."""
    vals, codes = O._positive_finite(fmt)
    mids = (vals[:-1] + vals[1:]) / 2
    assert np.all(mids.astype(np.float32) == mids)  # exactly representable in fp32
    lo, hi = codes[:-1].astype(int), codes[1:].astype(int)
    even = np.where(lo % 2 == 0, lo, hi)
    got = reference.encode_fp8(mids.astype(np.float32), fmt)
    assert np.array_equal(got, even)
    assert np.array_equal(reference.encode_fp8(-mids.astype(np.float32), fmt), even | 0x80)
    # saturation: max + half an ulp (a tie against the next, non-existent value) -> max
    top_half_ulp = (vals[-1] - vals[-2]) / 2
    for v in (vals[-1] + top_half_ulp, vals[-1] * 1.5, 1e38, math.inf):
        assert reference.encode_fp8(np.float32(v), fmt) == codes[-1]
        assert reference.encode_fp8(np.float32(-v), fmt) == codes[-1] | 0x80


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_specials(fmt):
    max_code = 0x7E if fmt is fb.E4M3 else 0x7B
    nan_patterns = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF],
                            dtype=np.uint32).view(np.float32)
    assert np.all(reference.encode_fp8(nan_patterns, fmt) == 0x7F)
    assert reference.encode_fp8(np.float32(0.0), fmt) == 0x00
    assert reference.encode_fp8(np.float32(-0.0), fmt) == 0x80
    assert reference.encode_fp8(np.float32(math.inf), fmt) == max_code
    assert reference.encode_fp8(np.float32(-math.inf), fmt) == max_code | 0x80
    step = 2.0 ** (fmt.min_normal_exponent - fmt.mantissa_bits)
    assert reference.encode_fp8(np.float32(step), fmt) == 0x01
    assert reference.encode_fp8(np.float32(step / 2), fmt) == 0x00  # tie -> even (0)
    assert reference.encode_fp8(np.float32(-step / 2), fmt) == 0x80
    assert reference.encode_fp8(np.float32(step * 0.5000001), fmt) == 0x01
    assert reference.encode_fp8(np.float32(O.bits_f32(1)), fmt) == 0x00  # fp32 subnormal
    assert reference.encode_fp8(np.float32(-O.bits_f32(1)), fmt) == 0x80


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_matches_ml_dtypes_where_defined(fmt):
    v = scaled_bf16_products()
    v = v[~np.isnan(v) & (np.abs(v) <= fmt.max)]
    want = v.astype(ML_DTYPE[fmt]).view(np.uint8)
    got = reference.encode_fp8(v, fmt)
    assert np.array_equal(got, want), show(v, got, want)


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_matches_torch_where_defined(fmt):
    torch = pytest.importorskip("torch")
    tdtype = torch.float8_e4m3fn if fmt is fb.E4M3 else torch.float8_e5m2
    v = scaled_bf16_products()
    v = v[~np.isnan(v) & (np.abs(v) <= fmt.max)]
    want = torch.from_numpy(v).to(tdtype).view(torch.uint8).numpy()
    got = reference.encode_fp8(v, fmt)
    assert np.array_equal(got, want), show(v, got, want)


def test_encode_keeps_shape():
    x = np.linspace(-500, 500, 2 * 3 * 7, dtype=np.float32).reshape(2, 3, 7)
    out = reference.encode_fp8(x, fb.E4M3)
    assert out.shape == (2, 3, 7) and out.dtype == np.uint8
    assert np.array_equal(out.ravel(), O.nearest_fp8_code(x.ravel(), fb.E4M3))
    assert reference.encode_fp8(np.zeros((0, 4), np.float32), fb.E5M2).shape == (0, 4)
    # non-contiguous input
    assert np.array_equal(reference.encode_fp8(x[:, ::2, 1:], fb.E4M3),
                          O.nearest_fp8_code(x[:, ::2, 1:], fb.E4M3))


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_table(fmt):
    codes = np.arange(256, dtype=np.uint8)
    table = reference.decode_fp8(codes, fmt)
    assert table.dtype == np.float32
    assert np.array_equal(table, O.fp8_code_values(fmt).astype(np.float32), equal_nan=True)
    assert np.array_equal(table, codes.view(ML_DTYPE[fmt]).astype(np.float32), equal_nan=True)
    assert np.isnan(table[0x7F]) and np.isnan(table[0xFF])
    if fmt is fb.E5M2:
        assert table[0x7C] == math.inf and table[0xFC] == -math.inf
    assert reference.decode_fp8(codes.reshape(16, 16), fmt).shape == (16, 16)


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_decode_roundtrip_every_finite_code(fmt):
    codes = np.arange(256, dtype=np.uint8)
    values = reference.decode_fp8(codes, fmt)
    finite = np.isfinite(values)
    assert np.array_equal(reference.encode_fp8(values[finite], fmt), codes[finite])
