"""FP8 formats and block-scaling recipes.

A *format* says how one FP8 byte encodes a number; a *recipe* says how a tensor is cut into
blocks and how each block's scale is chosen. Both are plain values: hashable, immutable, and
validated when built, so a kernel cache can key on them.
"""
from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass


class Format(enum.Enum):
    """FP8 storage format. ``.max`` is the largest finite value."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def max(self) -> float:
        return 448.0 if self is Format.E4M3 else 57344.0

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is Format.E4M3 else 2

    @property
    def exponent_bias(self) -> int:
        return 7 if self is Format.E4M3 else 15

    @property
    def min_normal_exponent(self) -> int:
        """log2 of the smallest normal value: -6 for E4M3, -14 for E5M2."""
        return 1 - self.exponent_bias

    @property
    def nan_code(self) -> int:
        """The byte written for NaN inputs (positive canonical NaN, as the CUDA cvt writes)."""
        return 0x7F

    def __repr__(self) -> str:
        return f"fp8blk.{self.name}"


E4M3 = Format.E4M3
E5M2 = Format.E5M2


def _check_format(fmt) -> None:
    if not isinstance(fmt, Format):
        raise TypeError(f"fmt must be fp8blk.E4M3 or fp8blk.E5M2, got {fmt!r}")


# Largest finite float32; the kernels and the reference compute in fp32, so an epsilon above
# it (finite as a Python float) would become inf there and silently give every block scale 1.
_FLT_MAX = 3.4028234663852886e38


def as_flag(value, name: str) -> bool:
    """``value`` as a bool: True/False or NumPy's ``np.True_``/``np.False_``; anything else
    (0/1, strings such as "False", None) is a TypeError naming ``name``. One rule for every
    on/off argument of fp8blk (``rowwise``, ``columnwise``, ``pow2_scales``, ``update_usage``):
    ``quantize(x, r, rowwise="False")`` must not be taken as true."""
    if value is True or value is False:
        return value
    if type(value).__name__ == "bool" and type(value).__module__ == "numpy":  # np.bool_
        return bool(value)
    raise TypeError(f"{name} must be True or False (a bool or numpy.bool_), got "
                    f"{value!r} ({type(value).__name__})")


def _check_fp32_scale_fields(pow2_scales, amax_epsilon) -> bool:
    """Checks the fields; returns pow2_scales as a plain bool."""
    pow2_scales = as_flag(pow2_scales, "pow2_scales")
    if isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float)):
        raise TypeError(f"amax_epsilon must be a float, got {amax_epsilon!r}")
    if not (0.0 <= amax_epsilon <= _FLT_MAX):
        raise ValueError(f"amax_epsilon must be >= 0 and finite in float32 (at most "
                         f"{_FLT_MAX:.8g}, since scales are computed in float32), got "
                         f"{amax_epsilon!r}")
    return pow2_scales


@dataclass(frozen=True)
class _Fp32ScaledRecipe:
    """Fields and validation shared by the recipes with fp32 block scales."""

    fmt: Format = Format.E4M3
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_format(self.fmt)
        object.__setattr__(self, "pow2_scales",
                           _check_fp32_scale_fields(self.pow2_scales, self.amax_epsilon))
        object.__setattr__(self, "amax_epsilon", float(self.amax_epsilon))
        _store_hash(self, (self.fmt, self.pow2_scales, self.amax_epsilon))


def _store_hash(recipe, fields):
    # Recipes key every per-call cache (kernel plans, layouts): the dataclass hash would hash
    # the fields (an Enum among them) on every lookup; computed once instead.
    object.__setattr__(recipe, "_hash", hash((type(recipe).__name__,) + fields))


def _cached_hash(recipe):
    return recipe._hash


@dataclass(frozen=True)
class Block1D(_Fp32ScaledRecipe):
    """1x128 blocks along K for rowwise data, 128x1 blocks along M for columnwise data.

    Scales are fp32; with ``pow2_scales`` they are rounded down to a power of two.
    """

    block_rows = 1
    block_cols = 128


@dataclass(frozen=True)
class Block2D(_Fp32ScaledRecipe):
    """128x128 tiles; columnwise data is the exact FP8 transpose of rowwise data."""

    block_rows = 128
    block_cols = 128


@dataclass(frozen=True)
class MXFP8:
    """OCP MX: 1x32 rowwise and 32x1 columnwise blocks, E8M0 (power-of-two) scales.

    Special values follow Transformer Engine: NaN gives the NaN byte; a block holding +-inf
    gets amax inf (E8M0 code 254, multiplier 2**-127), so each inf saturates to +-max, which the
    block's scale 2**127 dequantizes back to +-inf, and its finite values x become the cast of
    x * 2**-127 (0 unless huge) (docs/numerics.md)."""

    fmt: Format = Format.E4M3

    block_rows = 1
    block_cols = 32

    def __post_init__(self):
        _check_format(self.fmt)
        _store_hash(self, (self.fmt,))


Recipe = (Block1D, Block2D, MXFP8)
for _recipe_type in Recipe:  # after @dataclass, which would put back a field-hashing __hash__
    _recipe_type.__hash__ = _cached_hash


def check_recipe(recipe) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be fp8blk.Block1D(...), fp8blk.Block2D(...) or fp8blk.MXFP8(...), "
            f"got {recipe!r}"
        )


# -- the recipe vocabulary: one kind name, one key, one integer code per recipe ---------------

KINDS = ("Block1D", "Block2D", "MXFP8")   # a recipe's kind; its index is the kind's code
_CLASS_OF_KIND = {"Block1D": Block1D, "Block2D": Block2D, "MXFP8": MXFP8}
_KIND_OF_CLASS = {c: k for k, c in _CLASS_OF_KIND.items()}
_FORMATS = (E4M3, E5M2)                    # a format's index is its code


def recipe_kind(recipe) -> str:
    """"Block1D", "Block2D" or "MXFP8" (TypeError for anything that is not a recipe). Tables
    keyed by recipe kind use these names.

    >>> recipe_kind(MXFP8())
    'MXFP8'
    """
    kind = _KIND_OF_CLASS.get(type(recipe))
    if kind is None:
        check_recipe(recipe)  # raises for non-recipes; a subclass is its base's kind
        kind = next(k for c, k in _KIND_OF_CLASS.items() if isinstance(recipe, c))
    return kind


def recipe_key(recipe) -> str:
    """A string naming ``recipe`` exactly and stably across processes (:func:`recipe_from_key`
    inverts it): what torch custom ops and fingerprints take. Not cached: it runs while
    torch.compile traces, and dynamo warns about lru_cache-wrapped calls.

    >>> recipe_key(Block1D())
    'Block1D:e4m3:1:0.0'
    >>> recipe_from_key(recipe_key(Block2D(E5M2, False, 1e-12))) == Block2D(E5M2, False, 1e-12)
    True
    """
    kind = recipe_kind(recipe)
    if kind == "MXFP8":
        return f"MXFP8:{recipe.fmt.value}"
    return f"{kind}:{recipe.fmt.value}:{int(recipe.pow2_scales)}:{recipe.amax_epsilon!r}"


@functools.lru_cache(maxsize=256)
def recipe_from_key(key: str):
    """The recipe :func:`recipe_key` named (ValueError for a string that names none)."""
    parts = key.split(":")
    try:
        fmt = Format(parts[1])
        if parts[0] == "MXFP8" and len(parts) == 2:
            return MXFP8(fmt)
        if parts[0] in ("Block1D", "Block2D") and len(parts) == 4 and parts[2] in "01":
            return _CLASS_OF_KIND[parts[0]](fmt, parts[2] == "1", float(parts[3]))
    except (IndexError, ValueError):
        pass
    raise ValueError(f"{key!r} is not a recipe key (fp8blk.formats.recipe_key)")


def recipe_code(recipe) -> list:
    """``recipe`` as four non-negative ints (kind, format, pow2_scales, amax_epsilon's float64
    bits), for integer collectives that compare recipes across ranks;
    :func:`recipe_from_code` inverts it.

    >>> recipe_from_code(recipe_code(Block1D())) == Block1D()
    True
    """
    kind = recipe_kind(recipe)
    pow2 = int(getattr(recipe, "pow2_scales", True))
    eps = struct.unpack("<q", struct.pack("<d", float(getattr(recipe, "amax_epsilon", 0.0))))[0]
    return [KINDS.index(kind), _FORMATS.index(recipe.fmt), pow2, eps]


def recipe_from_code(code):
    kind, fmt, pow2, eps = (int(v) for v in code)
    fmt = _FORMATS[fmt]
    if KINDS[kind] == "MXFP8":
        return MXFP8(fmt)
    eps = struct.unpack("<d", struct.pack("<q", eps))[0]
    return _CLASS_OF_KIND[KINDS[kind]](fmt, bool(pow2), eps)


def check_mxfp8_shape(recipe, rows: int, cols: int, what: str = "the tensor",
                      shape=None) -> None:
    """The one check of MXFP8's shape rule: its 1x32 and 32x1 blocks need the (M, K) view's
    M and K to be multiples of 32 (ValueError naming ``what``, and ``shape`` when given: the
    message is built only on failure). Other recipes take any shape.

    >>> check_mxfp8_shape(MXFP8(), 64, 96)
    >>> check_mxfp8_shape(Block1D(), 1, 3)
    """
    if type(recipe) is MXFP8 and (rows % 32 or cols % 32):
        if shape is not None:
            what = f"{what} of shape {tuple(shape)}"
        raise ValueError(f"MXFP8 needs M and K to be multiples of 32 (its blocks are 1x32 and "
                         f"32x1): {what} is (M, K) = ({rows}, {cols}); pad it or use Block1D")
