"""What ``python -m fp8blk prebuild`` asks of the kernels: the common variants, which of them a
cache folder lacks, and a worker that compiles one into it; and what a process has built and
loaded (:func:`cache_counts`, :func:`loaded_cubins`: cold-start benchmarks and tests). Numba
is imported only by :func:`build` (on a compile).

The variants (:func:`common_variants`): quantize for every recipe (Block1D, Block2D, MXFP8 with
their default options) x E4M3 / E5M2 x fp32 / bf16 / fp16 input x rowwise / columnwise / both,
on aligned inputs (K a multiple of 8, M of 16, 16-byte aligned data); dequantize of each of
those buffers (aligned) to fp32 / bf16 / fp16; the Block2D transpose. Other variants (unaligned
shapes, other recipe options, the master-weight kernels, the RMSNorm kernels: a pair per row
width) compile on first use, once per cache folder. A variant is the pair (family, spec): family one of ``"quantize"``, ``"dequantize"``,
``"transpose"``, spec the frozen dataclass of ``_specs`` that fixes its generated code.

The cubins are made by the one compile route of a launch's cache miss (``_compiled``), so they
are the bytes a launch would have compiled.
"""
from __future__ import annotations

import time

from . import _cache, _compiled
from . import _specs as sp

# The kernels convert with cvt.rn.satfinite.e4m3x2 / e5m2x2, which need sm_89 or newer.
MIN_CC = (8, 9)


def cache_enabled() -> bool:
    """False when ``FP8BLK_KERNEL_CACHE=0`` turns the disk cache off."""
    return _cache.enabled()


def cache_dir() -> str:
    """The default cache folder: ``FP8BLK_CACHE_DIR``, else ``~/.cache/fp8blk``."""
    return _cache.cache_dir()


def cache_counts() -> dict:
    """{"builds", "loads"}: kernels this process compiled into the default cache folder and
    entries it read from it."""
    st = _cache.store()
    return {"builds": st.builds, "loads": st.loads}


def loaded_cubins(cc) -> dict:
    """{"<family>-<digest>": cubin bytes, or None where the default cache folder lacks it} of
    every variant this process has loaded, keyed for compute capability `cc` ((major, minor)):
    what processes sharing a cache compare."""
    st = _cache.store()
    out = {}
    for family, spec, _ in _compiled.loaded():
        digest, _ = _compiled.key(family, spec, cc)
        entry = st.read(family, digest)
        out[f"{family}-{digest}"] = None if entry is None else entry.cubin
    return out


def common_variants():
    """[(family, spec)] of the variants ``prebuild`` compiles (default settings)."""
    from ..formats import E4M3, E5M2, MXFP8, Block1D, Block2D
    from ..formats import recipe_kind
    from .dequantize import choose_path
    from .quantize import spec_for

    recipes = [r(fmt) for r in (Block1D, Block2D, MXFP8) for fmt in (E4M3, E5M2)]
    out = []
    for recipe in recipes:
        for kind in (sp.F32, sp.BF16, sp.F16):
            for rw, cw in ((True, False), (False, True), (True, True)):
                out.append(("quantize", spec_for(recipe, kind, rw, cw, True, True,
                                                 settings=sp.QuantizeSettings())))
    for recipe in recipes:
        for columnwise in (False, True):
            for out_kind in (sp.F32_OUT, sp.BF16_OUT, sp.F16_OUT):
                spec = sp.DequantizeSpec(recipe_kind(recipe), columnwise,
                                         recipe.fmt is E4M3, out_kind, None)
                # aligned 1024 x 1024 buffers: scale rows of 128 entries, addresses % 16 == 0
                out.append(("dequantize", choose_path(spec, 1024, 1024, 128, 0, 0)))
    out.append(("transpose", sp.TransposeSpec(True, True)))
    return out


def missing(variants, cc, root):
    """(number of distinct variants, [(family, spec)] of those the cache folder `root` lacks
    for compute capability `cc` ((major, minor)))."""
    store = _cache.Store(root)
    todo, seen = [], set()
    for family, spec in variants:
        digest, _ = _compiled.key(family, spec, cc)
        if digest in seen:
            continue
        seen.add(digest)
        if store.read(family, digest) is None:
            todo.append((family, spec))
    return len(seen), todo


def build(family, spec, cc, root):
    """Compile one variant for `cc` into the cache folder `root` (a worker process's job:
    Numba holds a global compiler lock, so parallel compiles need processes). Returns
    (whether this call compiled it, seconds)."""
    store = _cache.Store(root)
    t0 = time.perf_counter()
    _compiled.entry(family, spec, cc, store=store)
    return store.builds > 0, time.perf_counter() - t0


__all__ = ["MIN_CC", "cache_enabled", "cache_dir", "cache_counts", "loaded_cubins",
           "common_variants", "missing", "build"]
