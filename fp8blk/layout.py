"""Buffer layouts of every recipe and direction: shapes, dtypes and scale padding (the one
source; docs/layouts.md describes them).

An input (..., K) is viewed as (M, K) with M the product of the leading dims (:func:`shape2d`).
FP8 data is uint8. Scale tensors include their padding, which is always written: 1.0 for fp32
``scale_inv`` and 0 for E8M0 codes.

=========  =======================================  =======================================
recipe     rowwise data / scale_inv                 columnwise data / scale_inv
=========  =======================================  =======================================
Block1D    (M, K) / f32 (cdiv(K,128), round4(M))    (K, M) / f32 (cdiv(M,128), round4(K))
Block2D    (M, K) / f32 (cdiv(M,128),               (K, M) / f32 (cdiv(K,128),
           round4(cdiv(K,128)))                     round4(cdiv(M,128)))
MXFP8      (M, K) / u8 (round128(M), round4(K/32))  (M, K) / u8 (round4(M/32), round128(K))
=========  =======================================  =======================================

It imports only :mod:`fp8blk.formats` (the recipe vocabulary), so every other module can use it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .formats import recipe_kind

U8 = np.dtype(np.uint8)
F32 = np.dtype(np.float32)

BUFFER_NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """Smallest multiple of b that is >= a."""
    return -(-a // b) * b


def c_strides(shape) -> tuple:
    """Row-major (C-contiguous) strides of ``shape``, in elements."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def shape2d(shape) -> tuple:
    """(M, K) view of a shape (..., K): M is the product of the leading dims (plain ints:
    ``np.prod`` costs microseconds on the per-call path). A 0-d shape is (1, 1)."""
    if len(shape) == 0:
        return (1, 1)
    m = 1
    for d in shape[:-1]:
        m *= d
    return (m, shape[-1])


class Layout(NamedTuple):
    """Shape, dtype and padding value of one buffer (``fill`` None for data buffers)."""

    shape: tuple
    dtype: np.dtype
    fill: Optional[float]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def all_layouts(recipe, rows: int, cols: int) -> list:
    """[Layout] x 4: rowwise data, rowwise scale_inv, columnwise data, columnwise scale_inv of
    an (M, K) = (rows, cols) tensor. MXFP8 assumes M and K are multiples of 32."""
    kind = recipe_kind(recipe)
    if kind == "Block1D":
        return [Layout((rows, cols), U8, None),
                Layout((cdiv(cols, 128), round_up(rows, 4)), F32, 1.0),
                Layout((cols, rows), U8, None),
                Layout((cdiv(rows, 128), round_up(cols, 4)), F32, 1.0)]
    if kind == "Block2D":
        mt, kt = cdiv(rows, 128), cdiv(cols, 128)
        return [Layout((rows, cols), U8, None), Layout((mt, round_up(kt, 4)), F32, 1.0),
                Layout((cols, rows), U8, None), Layout((kt, round_up(mt, 4)), F32, 1.0)]
    return [Layout((rows, cols), U8, None),
            Layout((round_up(rows, 128), round_up(cols // 32, 4)), U8, 0),
            Layout((rows, cols), U8, None),
            Layout((round_up(rows // 32, 4), round_up(cols, 128)), U8, 0)]


def buffer_layouts(recipe, rows: int, cols: int, rowwise: bool = True,
                   columnwise: bool = False) -> list:
    """Like :func:`all_layouts`, with None for the buffers of a direction not held."""
    layouts = all_layouts(recipe, rows, cols)
    return ((layouts[:2] if rowwise else [None, None])
            + (layouts[2:] if columnwise else [None, None]))


__all__ = ["cdiv", "round_up", "c_strides", "shape2d", "Layout", "all_layouts",
           "buffer_layouts", "BUFFER_NAMES"]
