"""The compiled-kernel cache on the GPU (``pytest -m gpu tests/kernels``): the cache-on and
cache-off routes give the same cubins and output bytes, the route compiles the code a Numba
launch compiles, and a process with a warm cache launches without importing numba."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fp8blk.kernels import _cache
from fp8blk.kernels import _specs as sp

pytestmark = pytest.mark.gpu
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a few variants of each family the quantize / dequantize / transpose launchers use
VARIANTS = [
    ("quantize", sp.quantize_spec(sp.BLOCK1D, sp.BF16, True, True, True, True, 0.0,
                                  3.3895313892515355e38, True, True)),
    ("quantize", sp.quantize_spec(sp.MXFP8, sp.F32, False, True, True, False, 0.0,
                                  3.4028234663852886e38, True, True)),
    ("dequantize", sp.DequantizeSpec(sp.BLOCK1D, True, True, sp.BF16_OUT, sp.TILES, 0, False)),
    ("transpose", sp.TransposeSpec(True, False)),
    ("partial_amax", sp.partial_amax_spec(False, sp.BF16, True, True)),
]

# Runs in a fresh process: quantize / dequantize / transpose on fixed data, prints the sha256
# of every output and of every cubin the process loaded (``backend.loaded_cubins``), its
# cache counts and whether numba got imported.
_CHILD = r"""
import hashlib, json, sys
import numpy as np
import cupy
import fp8blk as fb
from fp8blk.kernels import backend as kernels
rng = np.random.default_rng(7)
x = (rng.standard_normal((1000, 1100)) * np.exp(rng.uniform(-8, 8, (1000, 1)))).astype(np.float32)
xd = cupy.asarray(x)
h = {}
for name, recipe in (("b1d", fb.Block1D()), ("b2d", fb.Block2D(fb.E5M2)),
                     ("mx", fb.MXFP8())):
    xi = xd if name != "mx" else xd[:992, :1088].copy()
    bufs = kernels.quantize(xi, recipe, True, True)
    h["q-" + name] = [hashlib.sha256(b.get().tobytes()).hexdigest() for b in bufs]
    y = kernels.dequantize(recipe, xi.shape, None, None, bufs[2], bufs[3], dtype=np.float16)
    h["dq-" + name] = hashlib.sha256(y.get().tobytes()).hexdigest()
d, s, _, _ = kernels.quantize(xd, fb.Block2D(), True, False)
t = kernels.block2d_columnwise_from_rowwise(d, s)
h["tr"] = [hashlib.sha256(b.get().tobytes()).hexdigest() for b in t]
counts = kernels.cache_counts()  # before loaded_cubins, which reads the store
cc = cupy.cuda.Device().compute_capability
cubins = {name: cubin and hashlib.sha256(cubin).hexdigest() for name, cubin in
          kernels.loaded_cubins((int(cc[:-1]), int(cc[-1]))).items()}
print(json.dumps({"hashes": h, "numba": "numba" in sys.modules, "cubins": cubins, **counts}))
"""


def _child(env_extra):
    env = dict(os.environ, PYTHONPATH=_REPO, **env_extra)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cache_on_and_off_give_the_same_cubins():
    """The stored cubin of a variant is byte for byte what the compile route gives with the
    cache off, for the device's compute capability."""
    import cupy

    cc = cupy.cuda.Device().compute_capability
    cc = (int(cc[:-1]), int(cc[-1]))
    for family, spec in VARIANTS:
        off = _cache.compile_variant(family, spec, cc)
        on = _cache.entry(family, spec, cc)
        assert (on.entry, on.cubin) == off, family


def test_route_compiles_what_a_numba_launch_compiles():
    """Registers, local and shared memory of the cubin from LTO-IR + nvJitLink equal those of
    Numba's own launch route (``_numba.compile_kernel``, a CUDA dispatcher)."""
    import cupy

    from fp8blk.kernels import _numba

    cc = cupy.cuda.Device().compute_capability
    cc = (int(cc[:-1]), int(cc[-1]))
    attrs = {"regs": 4, "local": 3, "shared": 1}
    for family, spec in VARIANTS:
        pyfunc, argtypes, bounds = _cache.builder(family)(spec)
        numba_fn = _numba.compile_kernel(pyfunc, argtypes, launch_bounds=bounds)
        e = _cache.entry(family, spec, cc)
        module = cupy.cuda.function.Module()
        module.load(e.cubin)
        ours = module.get_function(e.entry)
        for name, code in attrs.items():
            a = cupy.cuda.driver.funcGetAttribute(code, numba_fn.ptr)
            b = cupy.cuda.driver.funcGetAttribute(code, ours.ptr)
            assert a == b, f"{family} {spec}: {name} {a} (numba launch) vs {b} (cache route)"


def test_outputs_identical_with_cache_on_off_and_warm(tmp_path):
    """Fresh processes: cache off, cache on from empty (builds), cache on warm (loads only,
    numba never imported) give the same output bytes."""
    off = _child({"FP8BLK_KERNEL_CACHE": "0"})
    cold = _child({"FP8BLK_CACHE_DIR": str(tmp_path)})
    warm = _child({"FP8BLK_CACHE_DIR": str(tmp_path)})
    assert off["hashes"] == cold["hashes"] == warm["hashes"]
    assert cold["builds"] > 0 and cold["numba"]
    assert warm["builds"] == 0 and warm["loads"] == cold["builds"]
    assert not warm["numba"], "the warm-cache process imported numba"
    assert cold["cubins"] and None not in cold["cubins"].values()
    assert warm["cubins"] == cold["cubins"]


def test_kernels_load_per_device():
    """A variant is loaded once per device and reused (in-memory cache)."""
    import cupy

    spec = VARIANTS[3][1]
    k1 = _cache.kernel("transpose", spec)
    assert _cache.kernel("transpose", spec) is k1
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            k2 = _cache.kernel("transpose", spec)
        assert k2 is not k1


def test_stored_cubin_matches_its_header(tmp_path):
    import cupy

    cc = cupy.cuda.Device().compute_capability
    cc = (int(cc[:-1]), int(cc[-1]))
    store = _cache.Store(str(tmp_path))
    family, spec = VARIANTS[0]
    e = _cache.entry(family, spec, cc, store=store)
    assert e.meta["sha256"] == hashlib.sha256(e.cubin).hexdigest()
    assert e.meta["key"]["cc"] == list(cc)
    assert np.frombuffer(e.cubin[:4], np.uint8).tobytes() == b"\x7fELF"
