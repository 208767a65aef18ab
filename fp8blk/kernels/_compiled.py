"""Launchable kernels for the launchers: ``kernel(family, spec)``, from the disk cache or compiled.

On the GPU a kernel is a CuPy ``Function`` loaded from its cubin (raw-pointer launch on CuPy's
current stream, ~5 us of host time), kept in memory per (family, spec, device). The cubin comes
from the disk cache (``_cache``) or, on a miss, from :func:`compile_variant`, the one compile
route (also used by ``python -m fp8blk prebuild``, so prebuilt and launched cubins are the same
bytes): the family's builder makes the Python kernel, ``_numba.compile_cubin`` compiles it to
LTO-IR and links it with nvJitLink for the device's architecture. Neither this module nor the
hit path imports numba: builders are imported on a miss only.

Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) there is no cache: kernels are simulated
Python callables taking NumPy arrays.
"""
from __future__ import annotations

import importlib
import threading

from . import _cache
from ._sim import SIM

# family -> (builder module, its build function, kernel modules whose bytes enter the key).
# Every module a builder imports from fp8blk.kernels must be listed (tests check it).
_COMMON = ("_numba", "_kernel_lib", "_specs")
FAMILIES = {
    "quantize": ("_quantize_kernel", "build", ("_quantize_kernel",) + _COMMON),
    "dequantize": ("_dequantize_kernel", "build", ("_dequantize_kernel",) + _COMMON),
    "transpose": ("_transpose_kernel", "build", ("_transpose_kernel",) + _COMMON),
    "partial_amax": ("_partial_amax_kernel", "build", ("_partial_amax_kernel",) + _COMMON),
    "partial_scale": ("_partial_cast_kernel", "build_scale",
                      ("_partial_cast_kernel", "_partial_amax_kernel") + _COMMON),
    "partial_cast": ("_partial_cast_kernel", "build_cast",
                     ("_partial_cast_kernel", "_partial_amax_kernel") + _COMMON),
    "rms_norm": ("_rms_norm_kernel", "build", ("_rms_norm_kernel",) + _COMMON),
}

_loaded = {}                # (family, spec, device id) -> launchable
_lock = threading.RLock()   # one load / build at a time in this process


def loaded():
    """[(family, spec, device id)] of the variants this process has loaded."""
    with _lock:
        return list(_loaded)


def builder(family):
    """The family's build function ``build(spec) -> (pyfunc, argtypes, launch_bounds)``
    (imports its builder module, hence numba)."""
    mod, fn, _ = FAMILIES[family]
    return getattr(importlib.import_module(f"{__package__}.{mod}"), fn)


def sources(family):
    return _cache.kernel_sources(FAMILIES[family][2])


def key(family, spec, cc):
    """(digest, description) of a variant for compute capability `cc` ((major, minor))."""
    return _cache.variant_key(family, spec, cc, sources(family))


def compile_variant(family, spec, cc):
    """(entry name, cubin bytes) of a variant for `cc`: the one compile route (GPU misses and
    prebuild alike; works without a GPU)."""
    from . import _numba

    pyfunc, argtypes, bounds = builder(family)(spec)
    # "kernel_<family>": Nsight filters (bench/profile, run_gpu.sh) select "^kernel"
    return _numba.compile_cubin(pyfunc, argtypes, bounds, cc, name=f"kernel_{family}")


def entry(family, spec, cc, store=None):
    """The variant's cache Entry for `cc`: from the store (`store`, default the process's
    store of ``_cache.cache_dir()``), built and stored on a miss; compiled without storing
    when the cache is off."""
    digest, desc = key(family, spec, cc)
    build = lambda: compile_variant(family, spec, cc)  # noqa: E731
    if not _cache.enabled():
        name, cubin = build()
        return _cache.Entry(name, bytes(cubin), {"key": desc})
    return (store or _cache.store()).get_or_build(family, digest, desc, build)


def arg_dtypes(family, spec, n):
    """NumPy element dtypes of the first `n` (pointer) arguments: the simulator's flat views
    need them (simulator only: imports the builder)."""
    import numpy as np

    _, argtypes, _ = builder(family)(spec)
    return tuple(np.dtype(t.dtype.name) for t in argtypes[:n])


def _device_cc(cupy, dev):
    cc = cupy.cuda.Device(dev).compute_capability   # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


def kernel(family, spec, device=None):
    """Launchable ``f(grid, block, args)`` of a variant for CUDA device `device` (None: the
    current one) as a CuPy ``Function``, or under the simulator a simulated kernel taking NumPy
    arrays."""
    if SIM:
        k = _loaded.get((family, spec, None))
        if k is None:
            from . import _numba

            pyfunc, _, _ = builder(family)(spec)
            k = _loaded[(family, spec, None)] = _numba.sim_kernel(pyfunc)
        return k
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device is None else device
    k = _loaded.get((family, spec, dev))
    if k is not None:
        return k
    with _lock:
        k = _loaded.get((family, spec, dev))
        if k is None:
            e = entry(family, spec, _device_cc(cupy, dev))
            with cupy.cuda.Device(dev):  # a module belongs to the device it is loaded on
                # bind the primary context even when the runtime already reports `dev` (a
                # thread that made no runtime call yet, e.g. autograd's worker for GPU 0)
                cupy.cuda.runtime.setDevice(dev)
                module = cupy.cuda.function.Module()
                module.load(e.cubin)
            k = _loaded[(family, spec, dev)] = module.get_function(e.entry)
    return k
