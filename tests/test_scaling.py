"""fp8blk.scaling: the scale rules of docs/numerics.md on special and random amaxes, checked against
the scalar oracles in tests/_oracles.py and against hand-computed values."""
import math

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk import scaling
from tests import _oracles as O

FMTS = [fb.E4M3, fb.E5M2]
FLT_MAX = O.FLT_MAX
TINIEST = O.bits_f32(1)  # 2**-149


def as_bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def neighbours(value, count=3):
    """fp32 values within `count` ulps of `value` (positive, finite ones only)."""
    b = O.f32_bits(O.f32(value))
    out = [O.bits_f32(b + d) for d in range(-count, count + 1) if 0 <= b + d < 0x7F800000]
    return out


def special_amaxes(fmt):
    """Amaxes that exercise every branch: zero, signed zero, inf, NaN, subnormals, tiny normals
    around the point where F/amax overflows fp32, ordinary values, FLT_MAX."""
    threshold = fmt.max / FLT_MAX  # below about this, fl32(F/a) is inf
    values = [0.0, -0.0, math.inf, math.nan, TINIEST, 1e-40, 2.0 ** -126, 1e-12, 1e-30, 1.0,
              fmt.max, 3.0, 0.1, 1e30, FLT_MAX]
    values += neighbours(threshold, 4) + neighbours(2.0 ** -126, 2) + neighbours(1e-12, 2)
    return np.array(values, dtype=np.float32)


def random_positive_fp32(rng, n):
    """Random positive fp32 bit patterns: every exponent, subnormals, inf and NaN included."""
    bits = rng.integers(0, 0x7FFFFFFF, size=n, dtype=np.uint32, endpoint=True)
    return bits.view(np.float32)


VFI = [O.FLT_MAX, O.BF16_MAX, O.FP16_MAX]


# --------------------------------------------------------------------------------------------
# fp32 scales


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-12, 0.5])
@pytest.mark.parametrize("vfi", VFI)
def test_fp32_scale_matches_oracle(fmt, pow2, eps, vfi, rng):
    amax = np.concatenate([special_amaxes(fmt), random_positive_fp32(rng, 1500)])
    got = scaling.fp32_scale_from_amax(amax, fmt, pow2, eps, vfi)
    want = np.array([O.fp32_scale(float(a), fmt, pow2, eps, vfi) for a in amax],
                    dtype=np.float32)
    assert got.dtype == np.float32 and got.shape == amax.shape
    bad = np.nonzero(as_bits(got) != as_bits(want))[0]
    assert bad.size == 0, [(float(amax[i]), float(got[i]), float(want[i])) for i in bad[:5]]


def test_fp32_scale_hand_values():
    def s(a, fmt=fb.E4M3, pow2=False, eps=0.0, vfi=FLT_MAX):
        return float(scaling.fp32_scale_from_amax(np.float32(a), fmt, pow2, eps, vfi))

    assert s(1.0) == 448.0 and s(1.0, pow2=True) == 256.0
    assert s(448.0) == 1.0 and s(448.0, pow2=True) == 1.0
    assert s(2.0, fb.E5M2) == 28672.0 and s(3.0, fb.E5M2, True) == 16384.0
    for a in (0.0, -0.0, math.inf, math.nan):  # step 2
        assert s(a) == 1.0 and s(a, pow2=True) == 1.0
    # step 1: an amax below epsilon (including 0) is raised to epsilon
    assert s(0.0, eps=1e-12) == float(np.float32(448.0) / np.float32(1e-12))
    assert s(1e-13, eps=1e-12) == s(1e-12)
    assert s(math.nan, eps=1e-12) == 1.0  # NaN < eps is False, then step 2
    # step 3 is a correctly rounded fp32 division
    assert s(3.0) == float(np.float32(448.0) / np.float32(3.0)) == O.f32(448.0 / 3.0)
    # step 4: F / amax overflows -> the input dtype's largest value
    assert s(TINIEST) == FLT_MAX
    assert s(TINIEST, vfi=O.BF16_MAX) == O.BF16_MAX
    assert s(TINIEST, pow2=True) == 2.0 ** 127
    assert s(TINIEST, pow2=True, vfi=O.BF16_MAX) == 2.0 ** 127
    # step 5 on a non-power of two: 448/3 = 149.33 -> 128
    assert s(3.0, pow2=True) == 128.0


@pytest.mark.parametrize("fmt", FMTS)
def test_fp32_scale_overflow_threshold(fmt):
    """The smallest amax whose scale is finite, and the one below it, by exhaustive search of
    a few ulps around F / FLT_MAX."""
    cands = np.array(neighbours(fmt.max / FLT_MAX, 8), dtype=np.float32)
    scale = scaling.fp32_scale_from_amax(cands, fmt, False, 0.0, 123.0)
    with np.errstate(over="ignore"):
        exact_inf = np.isinf(np.float32(fmt.max) / cands)
    assert exact_inf.any() and not exact_inf.all()
    assert np.all((scale == np.float32(123.0)) == exact_inf)
    assert np.all(scale[~exact_inf] <= FLT_MAX)


def test_fp32_scale_shapes():
    a = np.full((2, 3, 4), 2.0, dtype=np.float32)
    out = scaling.fp32_scale_from_amax(a, fb.E4M3, True, 0.0, FLT_MAX)
    assert out.shape == (2, 3, 4) and out.dtype == np.float32 and np.all(out == 128.0)
    assert scaling.fp32_scale_from_amax(2.0, fb.E4M3, False, 0.0, FLT_MAX).shape == ()
    assert scaling.fp32_scale_from_amax(np.zeros((0, 3)), fb.E4M3, False, 0.0,
                                        FLT_MAX).shape == (0, 3)


def test_scale_inv(rng):
    specials = np.array([1.0, 2.0 ** 127, FLT_MAX, O.BF16_MAX, 448.0 / 3.0, 3.0, 2.0 ** -100,
                         448.0 / 1e-12], dtype=np.float32)
    scales = np.concatenate([specials, np.abs(random_positive_fp32(rng, 5000))])
    # real scales lie in [F / FLT_MAX, FLT_MAX]: normal fp32 values, whose reciprocal is finite
    scales = scales[np.isfinite(scales) & (scales >= 2.0 ** -126)]
    got = scaling.scale_inv_from_scale(scales)
    want = np.array([O.scale_inv(float(s)) for s in scales], dtype=np.float32)
    assert np.array_equal(as_bits(got), as_bits(want))
    assert float(scaling.scale_inv_from_scale(np.float32(2.0 ** 127))) == 2.0 ** -127
    assert float(scaling.scale_inv_from_scale(np.float32(FLT_MAX))) == O.f32(1 / FLT_MAX)


def test_dtype_max():
    assert scaling.dtype_max(np.float32) == FLT_MAX == scaling.FLT_MAX
    assert scaling.dtype_max(ml_dtypes.bfloat16) == O.BF16_MAX == 3.3895313892515355e38
    assert scaling.dtype_max(np.float16) == 65504.0


# --------------------------------------------------------------------------------------------
# E8M0


def e8m0_specials(fmt):
    """Amaxes whose v = a/F lands on, just below and just above every power of two (all fp32
    exponents incl. subnormal v), plus 0, inf, NaN and the v <= 2**-127 boundary."""
    values = [0.0, -0.0, math.inf, math.nan, TINIEST, FLT_MAX]
    inv = np.float32(1.0) / np.float32(fmt.max)
    for k in range(-150, 130):
        a = O.f32(fmt.max * 2.0 ** k)
        if 0 < a < math.inf:
            values += neighbours(a, 2)
    # amaxes with v exactly 2**-127 and one ulp either side (solve a * fl32(1/F) ~ 2**-127)
    values += neighbours(float(np.float32(2.0 ** -127) / inv), 6)
    return np.array(values, dtype=np.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_e8m0_from_amax_matches_oracle(fmt, rng):
    amax = np.concatenate([e8m0_specials(fmt), random_positive_fp32(rng, 20000)])
    got = scaling.e8m0_from_amax(amax, fmt)
    want = np.array([O.e8m0_code(float(a), fmt) for a in amax], dtype=np.uint8)
    assert got.dtype == np.uint8 and got.shape == amax.shape
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(amax[i]), int(got[i]), int(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("fmt", FMTS)
def test_e8m0_is_the_smallest_covering_power_of_two(fmt, rng):
    """Characterization independent of bit tricks: for finite v > 2**-127 the code c is the
    least integer with 2**(c-127) >= v; v <= 2**-127 gives 0; codes are monotone in amax."""
    amax = np.concatenate([e8m0_specials(fmt), random_positive_fp32(rng, 200000)])
    amax = np.sort(amax[np.isfinite(amax)])
    codes = scaling.e8m0_from_amax(amax, fmt).astype(np.int64)
    v = (amax * (np.float32(1) / np.float32(fmt.max))).astype(np.float64)
    big = v > 2.0 ** -127
    assert np.all(codes[~big] == 0)
    c = codes[big]
    assert np.all(np.ldexp(1.0, c - 127) >= v[big])
    assert np.all(np.ldexp(1.0, c - 128) < v[big])
    assert np.all(np.diff(codes) >= 0)  # monotone: MAX of codes == code of MAX


@pytest.mark.parametrize("fmt", FMTS)
def test_e8m0_edge_codes(fmt):
    inv = np.float32(1.0) / np.float32(fmt.max)

    def code(a):
        return int(scaling.e8m0_from_amax(np.float32(a), fmt))

    assert code(0.0) == 0 and code(-0.0) == 0
    assert code(math.inf) == 254 and code(math.nan) == 255
    assert code(fmt.max) == 127 and code(np.nextafter(np.float32(fmt.max), np.float32(0))) == 127
    assert code(np.nextafter(np.float32(fmt.max), np.float32(np.inf))) == 128
    # v <= 2**-127 -> 0, just above -> 1, 2**-126 -> 1, just above -> 2
    for a in neighbours(float(np.float32(2.0 ** -127) / inv), 6):
        v = float(np.float32(a) * inv)
        want = 0 if v <= 2.0 ** -127 else (1 if v <= 2.0 ** -126 else 2)
        assert code(a) == want, (a, v)
    # the largest finite amax never reaches the codes reserved for inf/NaN
    assert code(FLT_MAX) == 127 + math.ceil(math.log2(float(np.float32(FLT_MAX) * inv)))
    assert code(FLT_MAX) < 254


def test_e8m0_cast_multiplier_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = scaling.e8m0_cast_multiplier(codes)
    want = np.array([O.e8m0_multiplier(c) for c in range(256)], dtype=np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(as_bits(got[:255]), as_bits(want[:255])) and np.isnan(want[255])
    # TE 2.20.2's exp2f_rcp bits (transformer_engine/common/util/ptx.cuh)
    assert list(as_bits(got[[0, 1, 127, 253, 254, 255]])) == [
        0x7F000000, 0x7E800000, 0x3F800000, 0x00800000, 0x00400000, 0x7FFFFFFF]


def test_e8m0_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = scaling.e8m0_decode(codes)
    want = np.array([O.e8m0_value(c) for c in range(256)], dtype=np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(got, want, equal_nan=True)
    assert got[0] == 2.0 ** -127 and as_bits(got[0]) == 0x00400000
    assert got[1] == 2.0 ** -126 and got[127] == 1.0 and got[254] == 2.0 ** 127
    assert np.isnan(got[255])
    # TE 2.20.2's exp2f bits; decode and cast multiplier are exact reciprocals but for 255
    assert list(as_bits(got[[0, 1, 127, 254]])) == [0x00400000, 0x00800000, 0x3F800000,
                                                    0x7F000000]
    mult = scaling.e8m0_cast_multiplier(codes)
    assert np.all(got[:255].astype(np.float64) * mult[:255] == 1.0)


def test_e8m0_shapes():
    a = np.ones((3, 5), dtype=np.float32)
    assert scaling.e8m0_from_amax(a, fb.E4M3).shape == (3, 5)
    assert scaling.e8m0_cast_multiplier(np.zeros((2, 0), np.uint8)).shape == (2, 0)
    assert scaling.e8m0_decode(np.zeros((4,), np.uint8)).shape == (4,)
