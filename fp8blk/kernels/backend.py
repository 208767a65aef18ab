"""The kernels' door for the rooms above (docs/index.md):

* the device backend ``fp8blk._dispatch`` picks for CuPy arrays and torch CUDA tensors: the
  functions of ``fp8blk.reference`` with the same signatures, on device arrays, asynchronous
  on the array family's current stream (``quantize`` also takes ``dtype``, the logical input
  dtype: CuPy bf16 arrays are uint16 bit patterns);
* the tuning settings the launchers' ``use_settings`` take (``quantize.use_settings``,
  ``dequantize.use_settings``, ``partial.use_settings``), for benchmarks and sweeps; every
  field is a spec field, so kernels built under other settings are other cache entries;
* what ``python -m fp8blk prebuild`` asks of the kernels (:func:`common_variants`,
  :func:`missing`, :func:`build`) and what a process has built and loaded.
"""
from __future__ import annotations

import time

from ..formats import E4M3, E5M2, MXFP8, Block1D, Block2D, recipe_kind
from . import _cache
from . import _specs as sp
from ._specs import DequantizeSettings, MasterSettings, QuantizeSettings
from .dequantize import choose_path, dequantize
from .quantize import quantize, spec_for
from .transpose import block2d_columnwise_from_rowwise

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
    for family, spec, _ in _cache.loaded():
        digest, _ = _cache.key(family, spec, cc)
        entry = st.read(family, digest)
        out[f"{family}-{digest}"] = None if entry is None else entry.cubin
    return out


def common_variants():
    """[(family, spec)] of the variants ``prebuild`` compiles (default settings; `family` one
    of "quantize", "dequantize", "transpose", `spec` the ``_specs`` dataclass that fixes its
    code): quantize for every recipe (default options) x E4M3 / E5M2 x fp32 / bf16 / fp16 input
    x rowwise / columnwise / both, on aligned inputs (K a multiple of 8, M of 16, 16-byte
    aligned data); dequantize of each of those buffers to fp32 / bf16 / fp16; the Block2D
    transpose; the quantize groups of a default-config Float8BlockLinear's lean step per input
    dtype (x 1x128 rowwise [+ columnwise] with W 128x128 rowwise; dY 1x128 rowwise [+
    columnwise] with W 128x128 columnwise [+ x 1x128 columnwise]). Other variants (unaligned
    shapes, other recipe options, the master-weight and RMSNorm kernels) compile on first use,
    once per cache folder."""
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
    act, wgt = Block1D(E4M3), Block2D(E4M3)
    for kind in (sp.F32, sp.BF16, sp.F16):
        def q(recipe, rw, cw, kind=kind):
            return spec_for(recipe, kind, rw, cw, True, True, settings=sp.QuantizeSettings())
        for parts in ([q(act, True, True), q(wgt, True, False)],
                      [q(act, True, False), q(wgt, True, False)],
                      [q(act, True, True), q(wgt, False, True)],
                      [q(act, True, True), q(wgt, False, True), q(act, False, True)],
                      [q(act, True, False), q(wgt, False, True)]):
            out.append(("quantize_group", sp.quantize_group_spec(parts)))
    return out


def missing(variants, cc, root):
    """(number of distinct variants, [(family, spec)] of those the cache folder `root` lacks
    for compute capability `cc` ((major, minor)))."""
    store = _cache.Store(root)
    todo, seen = [], set()
    for family, spec in variants:
        digest, _ = _cache.key(family, spec, cc)
        if digest in seen:
            continue
        seen.add(digest)
        if store.read(family, digest) is None:
            todo.append((family, spec))
    return len(seen), todo


def build(family, spec, cc, root):
    """Compile one variant for `cc` into the cache folder `root` (a worker process's job:
    Numba holds a global compiler lock, so parallel compiles need processes), through the one
    compile route of a launch's cache miss: the bytes a launch would have compiled. Returns
    (whether this call compiled it, seconds)."""
    store = _cache.Store(root)
    t0 = time.perf_counter()
    _cache.entry(family, spec, cc, store=store)
    return store.builds > 0, time.perf_counter() - t0


__all__ = ["quantize", "dequantize", "block2d_columnwise_from_rowwise",
           "QuantizeSettings", "DequantizeSettings", "MasterSettings",
           "MIN_CC", "cache_enabled", "cache_dir", "cache_counts", "loaded_cubins",
           "common_variants", "missing", "build"]
