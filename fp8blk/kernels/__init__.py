"""Numba CUDA kernels: the GPU backend of fp8blk, for CuPy arrays and torch CUDA tensors.

Each operation is a launcher ``<op>.py`` (quantize, dequantize, transpose, rms_norm, partial,
grouped_gemm) beside its builder(s) ``_<op>_kernel.py`` (Numba code, compiled on first use per
variant; the grouped GEMMs' Hopper instructions are ``_hopper``'s, on the GPU only);
``backend`` is the door for the rooms above (device functions, tuning settings, prebuild);
``_cache`` gives launchers their kernels (disk cache, compile route), ``_launch`` the array
families and plan caches, ``_specs`` what both sides share, ``_numba`` the one module that
imports numba.cuda (a process whose kernels are cached never imports it). docs/index.md.
"""
from . import backend

__all__ = ["backend"]
