"""fp8blk.formats: the two FP8 formats and the three recipes (validation, immutability)."""
import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk.formats import Format, check_recipe

ML_DTYPE = {fb.E4M3: ml_dtypes.float8_e4m3fn, fb.E5M2: ml_dtypes.float8_e5m2}


def test_public_names():
    assert fb.E4M3 is Format.E4M3 and fb.E5M2 is Format.E5M2
    assert fb.E4M3.max == 448.0 and fb.E5M2.max == 57344.0
    assert repr(fb.E4M3) == "fp8blk.E4M3"


@pytest.mark.parametrize("fmt", [fb.E4M3, fb.E5M2])
def test_format_constants_match_ml_dtypes(fmt):
    info = ml_dtypes.finfo(ML_DTYPE[fmt])
    assert fmt.max == float(info.max)
    assert 2.0 ** fmt.min_normal_exponent == float(info.smallest_normal)
    # subnormal step = 2**(emin - mantissa_bits)
    assert 2.0 ** (fmt.min_normal_exponent - fmt.mantissa_bits) == float(info.smallest_subnormal)
    assert fmt.mantissa_bits == info.nmant
    assert fmt.nan_code == 0x7F
    assert math.isnan(float(np.uint8(fmt.nan_code).view(ML_DTYPE[fmt])))


def test_format_fields():
    e4, e5 = fb.E4M3, fb.E5M2
    assert (e4.mantissa_bits, e4.exponent_bias, e4.min_normal_exponent) == (3, 7, -6)
    assert (e5.mantissa_bits, e5.exponent_bias, e5.min_normal_exponent) == (2, 15, -14)


@pytest.mark.parametrize("cls", [fb.Block1D, fb.Block2D])
def test_fp32_recipe_defaults_and_blocks(cls):
    r = cls()
    assert (r.fmt, r.pow2_scales, r.amax_epsilon) == (fb.E4M3, True, 0.0)
    assert (r.block_rows, r.block_cols) == ((1, 128) if cls is fb.Block1D else (128, 128))
    r2 = cls(fb.E5M2, pow2_scales=False, amax_epsilon=1e-12)
    assert (r2.fmt, r2.pow2_scales, r2.amax_epsilon) == (fb.E5M2, False, 1e-12)


def test_mxfp8_defaults():
    r = fb.MXFP8()
    assert r.fmt is fb.E4M3 and (r.block_rows, r.block_cols) == (1, 32)
    assert fb.MXFP8(fb.E5M2).fmt is fb.E5M2
    with pytest.raises(TypeError):
        fb.MXFP8(fb.E4M3, True)  # MXFP8 has no pow2/epsilon fields
    with pytest.raises(TypeError):
        fb.MXFP8(pow2_scales=False)


@pytest.mark.parametrize("recipe", [fb.Block1D(), fb.Block2D(), fb.MXFP8()])
def test_recipes_are_frozen_hashable_values(recipe):
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fmt = fb.E5M2
    same = type(recipe)()
    assert recipe == same and hash(recipe) == hash(same)
    assert len({recipe, same}) == 1
    assert recipe != type(recipe)(fb.E5M2)


def test_recipe_types_differ():
    assert fb.Block1D() != fb.Block2D()


def test_integer_epsilon_is_stored_as_float():
    r = fb.Block1D(amax_epsilon=0)
    assert isinstance(r.amax_epsilon, float) and r.amax_epsilon == 0.0
    assert fb.Block2D(amax_epsilon=1).amax_epsilon == 1.0


@pytest.mark.parametrize("cls", [fb.Block1D, fb.Block2D, fb.MXFP8])
@pytest.mark.parametrize("bad", ["e4m3", None, 0, np.float32])
def test_bad_fmt_is_type_error(cls, bad):
    with pytest.raises(TypeError, match="fmt"):
        cls(bad)


@pytest.mark.parametrize("cls", [fb.Block1D, fb.Block2D])
@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_bad_pow2_is_type_error(cls, bad):
    with pytest.raises(TypeError, match="pow2_scales"):
        cls(fb.E4M3, pow2_scales=bad)


@pytest.mark.parametrize("cls", [fb.Block1D, fb.Block2D])
@pytest.mark.parametrize("bad", [True, "1e-12", None, [0.0]])
def test_bad_epsilon_type_is_type_error(cls, bad):
    with pytest.raises(TypeError, match="amax_epsilon"):
        cls(amax_epsilon=bad)


@pytest.mark.parametrize("cls", [fb.Block1D, fb.Block2D])
@pytest.mark.parametrize("bad", [-1e-12, -1, math.nan, math.inf])
def test_bad_epsilon_value_is_value_error(cls, bad):
    with pytest.raises(ValueError, match="amax_epsilon"):
        cls(amax_epsilon=bad)


@pytest.mark.parametrize("bad", [None, "Block1D", fb.Block1D, fb.E4M3, object()])
def test_check_recipe_rejects_non_recipes(bad):
    with pytest.raises(TypeError, match="recipe"):
        check_recipe(bad)


@pytest.mark.parametrize("recipe", [fb.Block1D(), fb.Block2D(fb.E5M2), fb.MXFP8()])
def test_check_recipe_accepts_recipes(recipe):
    check_recipe(recipe)


def test_recipe_vocabulary_round_trips_and_rejects():
    """One vocabulary: kind, key and code name each recipe exactly and invert; the kernels'
    spec tags are the kinds."""
    from fp8blk import formats
    from fp8blk.kernels import _specs
    recipes = [fb.Block1D(), fb.Block2D(fb.E5M2, False, 1e-12), fb.Block1D(amax_epsilon=3e-7),
               fb.MXFP8(), fb.MXFP8(fb.E5M2)]
    for r in recipes:
        assert formats.recipe_from_key(formats.recipe_key(r)) == r
        assert formats.recipe_from_code(formats.recipe_code(r)) == r
        assert min(formats.recipe_code(r)) >= 0  # MAX all-reduces carry it
    assert len({formats.recipe_key(r) for r in recipes}) == len(recipes)
    assert (_specs.BLOCK1D, _specs.BLOCK2D, _specs.MXFP8) == formats.KINDS
    for bad in ["Block1D", "MXFP8:e4m3:1", "Block3D:e4m3:1:0.0", "Block1D:e9m9:1:0.0"]:
        with pytest.raises(ValueError, match="not a recipe key"):
            formats.recipe_from_key(bad)
    with pytest.raises(TypeError, match="recipe must be"):
        formats.recipe_kind("Block1D")


def test_mxfp8_shape_rule_is_one_check():
    from fp8blk.formats import check_mxfp8_shape
    check_mxfp8_shape(fb.MXFP8(), 64, 32)
    check_mxfp8_shape(fb.Block1D(), 63, 31)
    with pytest.raises(ValueError, match=r"x of shape \(2, 32, 48\) is \(M, K\) = \(64, 48\)"):
        check_mxfp8_shape(fb.MXFP8(), 64, 48, "x", (2, 32, 48))
