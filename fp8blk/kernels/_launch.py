"""Host-side helpers shared by the launchers: input kinds, launch-plan caches, the tuning
settings, scalar arguments (allocation, pointers and launches are per array family:
``_adapters``)."""
from __future__ import annotations

import numpy as np

from .._arrays import BF16
from .._bounded import BoundedCache
from ..layout import cdiv, round_up  # noqa: F401  (re-exported for the launchers)
from . import _specs as sp
from ._sim import SIM

_KIND_OF = {np.dtype(np.float32): sp.F32, np.dtype(np.float16): sp.F16}


_KINDS = {}  # (stored dtype, logical dtype) -> kind: the per-call lookup


def kind_of(stored, dtype):
    """Input kind (sp.F32 / BF16 / F16) from the logical dtype `dtype` (None: the stored one)
    and the array's stored dtype `stored` (CuPy holds bf16 as uint16)."""
    kind = _KINDS.get((stored, dtype))
    if kind is None:
        kind = _KINDS[(stored, dtype)] = _kind_slow(stored, dtype)
    return kind


def _kind_slow(stored, dtype):
    logical = np.dtype(dtype) if dtype is not None else stored
    if logical == BF16:
        kind = sp.BF16
    else:
        kind = _KIND_OF.get(logical)
        if kind is None:
            raise TypeError(f"quantize takes float32, bfloat16 or float16 input, got {logical}")
    if stored.itemsize != sp.ITEMSIZE[kind]:
        raise TypeError(f"array of dtype {stored} does not hold {logical} elements")
    return kind


def module_of(arr):
    """numpy or cupy, whichever `arr` belongs to."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def data_ptr(arr) -> int:
    return arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr


PLAN_CACHE_SIZE = 4096  # a program cycling through more call signatures rebuilds plans


def plan_cache():
    """A launcher's cache of launch plans (or of validated calls) keyed by call signature:
    least recently used out past :data:`PLAN_CACHE_SIZE` (never unbounded memory)."""
    return BoundedCache(PLAN_CACHE_SIZE)


def cached_plan(cache, key, build):
    """``cache[key]``, built with ``build(*key)`` on a miss: the per-call lookup of the
    kernels' launch plans (`cache` from :func:`plan_cache`)."""
    plan = cache.get(key)
    if plan is None:
        plan = cache.put(key, build(*key))
    return plan


class Tuning:
    """A launcher's settings (a ``_specs`` settings dataclass) and the caches built under them.
    Every setting is a field of the kernels' specs, so kernels of different settings are
    different cache entries on disk; in memory, :meth:`use` empties `caches`."""

    def __init__(self, settings, caches):
        self.settings, self._caches = settings, tuple(caches)

    def use(self, settings):
        """Make `settings` (of the launcher's settings type) the tuning of later calls
        (benchmarks and sweeps); returns the previous settings."""
        kind = type(self.settings)
        if not isinstance(settings, kind):
            raise TypeError(f"settings must be a {kind.__name__}, got {type(settings).__name__}")
        previous, self.settings = self.settings, settings
        for cache in self._caches:
            cache.clear()
        return previous


def scalars(*values):
    """A kernel's int64 scalar arguments, as a tuple of NumPy int64 (the type CuPy's launch and
    the simulator need; the raw launch writes each as 8 bytes)."""
    return tuple(np.int64(v) for v in values)
