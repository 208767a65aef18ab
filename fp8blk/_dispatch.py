"""Chooses the backend for an internal array: the NumPy reference for host arrays, the Numba
CUDA kernels for device arrays (CuPy arrays and torch CUDA tensors).

A backend module provides the functions the reference does, with the same signatures:
``quantize(x2d, recipe, rowwise, columnwise)``, ``dequantize(recipe, shape2d, ..., dtype)`` and
``block2d_columnwise_from_rowwise(rowwise_data, rowwise_scale_inv)``.
"""
from __future__ import annotations

import numpy as np

from . import _arrays, reference


_kernels = None  # fp8blk.kernels.backend, imported on first device use


def backend_for(arr):
    """``fp8blk.reference`` for host arrays, ``fp8blk.kernels.backend`` for device arrays."""
    global _kernels
    if type(arr) is not np.ndarray and _arrays.on_gpu(arr):
        if _kernels is None:
            from .kernels import backend

            _kernels = backend
        return _kernels
    return reference
