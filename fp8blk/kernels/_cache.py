"""The compiled-kernel cache: :func:`kernel` gives a launcher its launchable kernel for a
(family, spec): from memory, from fp8blk's disk cache (one cubin per variant under an explicit
key, :class:`Store`), or compiled on a miss by the one compile route (:func:`compile_variant`,
which ``python -m fp8blk prebuild`` uses too). Neither this module nor the hit path imports
numba. Key, file format, locking and environment: docs/api.md, "Compiled-kernel cache".
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import namedtuple

from ._specs import SIM

MAGIC = b"FP8BLK-CUBIN-1\n"
KEY_FORMAT = 1          # bump when the key's meaning changes
_HERE = os.path.dirname(os.path.abspath(__file__))

# Distributions whose versions enter the key. The NVVM and nvJitLink libraries ship in several
# wheels depending on the CUDA major version; whichever are installed are recorded.
TOOLCHAIN = ("numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core",
             "nvidia-nvjitlink", "nvidia-nvjitlink-cu13", "nvidia-nvjitlink-cu12",
             "nvidia-nvvm", "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu13", "nvidia-cuda-nvcc-cu12",
             "cuda-toolkit")

# One variant in the store: the kernel's entry (mangled) name, the cubin, the header.
Entry = namedtuple("Entry", ["entry", "cubin", "meta"])


def enabled() -> bool:
    """Whether the disk cache is on (``FP8BLK_KERNEL_CACHE`` is not ``0``)."""
    return os.environ.get("FP8BLK_KERNEL_CACHE", "1").strip() != "0"


def cache_dir() -> str:
    """The cache folder: ``FP8BLK_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp8blk``, else
    ``~/.cache/fp8blk``."""
    d = os.environ.get("FP8BLK_CACHE_DIR")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fp8blk")


# ---- key ------------------------------------------------------------------------------------

_file_hashes = {}
_toolchain = None


def source_hash(paths) -> str:
    """sha256 over the bytes of the files `paths` (each read once per process), in order."""
    h = hashlib.sha256()
    for p in paths:
        fh = _file_hashes.get(p)
        if fh is None:
            with open(p, "rb") as f:
                fh = _file_hashes[p] = hashlib.sha256(f.read()).hexdigest()
        h.update(os.path.basename(p).encode() + b"\0" + fh.encode() + b"\0")
    return h.hexdigest()


def kernel_sources(names):
    """Paths of kernel modules `names` ("_quantize_kernel", ...) of this package."""
    return tuple(os.path.join(_HERE, n + ".py") for n in names)


def _normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_versions(names):
    """{name: version} of the distributions `names` installed on sys.path, from the names of
    their ``.dist-info`` / ``.egg-info`` folders (first on sys.path wins, as for
    ``importlib.metadata``): one listdir per path entry, far cheaper than importing
    ``importlib.metadata`` and looking each name up, on the cache-hit path of every process."""
    want = {_normalize(n): n for n in names}
    found = {}
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        for d in listing:
            if not d.endswith((".dist-info", ".egg-info")):
                continue
            parts = d.rsplit(".", 1)[0].split("-")
            if len(parts) < 2:
                continue
            name = want.get(_normalize(parts[0]))
            if name is not None and name not in found:
                found[name] = parts[1]
    return found


def toolchain() -> dict:
    """{distribution: version} of the compiler toolchain (installed ones), the Python version,
    and CUDA_HOME / CUDA_PATH (a toolkit outside the wheels); computed once per process."""
    global _toolchain
    if _toolchain is None:
        tc = _installed_versions(TOOLCHAIN)
        if "numba-cuda" not in tc:  # an unusual install (zipped eggs...): ask the slow way
            from importlib import metadata

            for name in TOOLCHAIN:
                try:
                    tc[name] = metadata.version(name)
                except metadata.PackageNotFoundError:
                    pass
        tc["python"] = "%d.%d" % sys.version_info[:2]
        for var in ("CUDA_HOME", "CUDA_PATH"):
            if os.environ.get(var):
                tc[var] = os.environ[var]
        _toolchain = tc
    return _toolchain


def _plain(v):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return float.hex(v)  # exact, and 0.0 != -0.0
    if isinstance(v, tuple):  # a group's part specs
        return [_plain(e) for e in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"spec_type": type(v).__name__, "spec": spec_fields(v)}
    raise TypeError(f"spec field value {v!r} ({type(v).__name__}) has no exact key form")


def spec_fields(spec) -> dict:
    """{field: value} of a spec dataclass, values as exact plain JSON types."""
    return {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def variant_key(family, spec, cc, sources):
    """(digest, description) of one variant: `family` (e.g. "quantize"), its `spec` (a frozen
    dataclass), target compute capability `cc` ((major, minor)), kernel source `paths`."""
    desc = {"format": KEY_FORMAT, "family": family, "spec_type": type(spec).__name__,
            "spec": spec_fields(spec), "cc": [int(cc[0]), int(cc[1])],
            "sources": source_hash(sources), "toolchain": toolchain()}
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest(), desc


# ---- store ----------------------------------------------------------------------------------


def _pack(entry, cubin, desc, seconds):
    header = {"entry": entry, "size": len(cubin), "sha256": hashlib.sha256(cubin).hexdigest(),
              "key": desc, "build_seconds": round(seconds, 3), "built_by": _who()}
    hb = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(hb).to_bytes(8, "little") + hb + cubin


def _unpack(blob):
    """Entry of a stored file, or None if it fails any check."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        return None
    n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    try:
        meta = json.loads(blob[start:start + n])
    except ValueError:
        return None
    cubin = blob[start + n:]
    if not isinstance(meta, dict) or meta.get("size") != len(cubin) \
            or meta.get("sha256") != hashlib.sha256(cubin).hexdigest():
        return None
    return Entry(meta["entry"], cubin, meta)


def _who():
    return f"{os.uname().nodename}:{os.getpid()}"


class Store:
    """The cubins of one cache folder: ``<family>-<digest>.cubin`` files (a JSON header, then
    the cubin), atomic writes, a per-key lock for builds, ``builds.log`` (docs/api.md)."""

    def __init__(self, root=None):
        self.root = root or cache_dir()
        self.builds = 0     # builds by this process (tests and benchmarks read them)
        self.loads = 0      # entries read from disk by this process

    def path(self, family, digest):
        return os.path.join(self.root, f"{family}-{digest}.cubin")

    def read(self, family, digest):
        """The stored Entry, or None (absent or failing its checks)."""
        try:
            with open(self.path(family, digest), "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        entry = _unpack(blob)
        if entry is not None:
            self.loads += 1
        return entry

    def get_or_build(self, family, digest, desc, build):
        """The Entry of `digest`: read from disk, or built with ``build() -> (entry name, cubin
        bytes)`` and stored. Concurrent callers of one key (threads or processes) build it
        once: the first takes the key's lock, the others wait on it and then read the file."""
        hit = self.read(family, digest)
        if hit is not None:
            return hit
        os.makedirs(self.root, exist_ok=True)
        path = self.path(family, digest)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            hit = self.read(family, digest)        # built while we waited for the lock
            if hit is not None:
                return hit
            t0 = time.perf_counter()
            name, cubin = build()
            seconds = time.perf_counter() - t0
            cubin = bytes(cubin)
            blob = _pack(name, cubin, desc, seconds)
            self._write(path, blob)
            self.builds += 1
            self._log(family, digest, seconds)
            return _unpack(blob)
        finally:
            os.close(fd)  # releases the lock

    def _write(self, path, blob):
        """Atomic replace of `path` by `blob` (temporary file in the same folder)."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=os.path.basename(path) + ".",
                                   suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _log(self, family, digest, seconds):
        line = json.dumps({"time": time.time(), "by": _who(), "family": family,
                           "digest": digest, "seconds": round(seconds, 3)}) + "\n"
        # one write of a short line in append mode: lines of concurrent writers never mix
        fd = os.open(os.path.join(self.root, "builds.log"),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


_stores = {}


def store(root=None) -> Store:
    """The process's Store of folder `root` (default :func:`cache_dir`)."""
    root = root or cache_dir()
    s = _stores.get(root)
    if s is None:
        s = _stores[root] = Store(root)
    return s


_store_of = store  # for :func:`entry`, whose `store` argument hides the function


# ---- launchable kernels -------------------------------------------------------------------

# family -> (builder module, its build function, kernel modules whose bytes enter the key).
# Every module a builder imports from fp8blk.kernels must be listed (tests check it).
_COMMON = ("_numba", "_kernel_lib", "_specs")
FAMILIES = {
    "quantize": ("_quantize_kernel", "build", ("_quantize_kernel",) + _COMMON),
    "quantize_group": ("_quantize_kernel", "build_group", ("_quantize_kernel",) + _COMMON),
    "dequantize": ("_dequantize_kernel", "build", ("_dequantize_kernel",) + _COMMON),
    "transpose": ("_transpose_kernel", "build", ("_transpose_kernel",) + _COMMON),
    "partial_amax": ("_partial_amax_kernel", "build", ("_partial_amax_kernel",) + _COMMON),
    "partial_scale": ("_partial_cast_kernel", "build_scale",
                      ("_partial_cast_kernel", "_partial_amax_kernel") + _COMMON),
    "partial_cast": ("_partial_cast_kernel", "build_cast",
                     ("_partial_cast_kernel", "_partial_amax_kernel") + _COMMON),
    "rms_norm": ("_rms_norm_kernel", "build", ("_rms_norm_kernel",) + _COMMON),
    "silu_gate": ("_silu_gate_kernel", "build", ("_silu_gate_kernel",) + _COMMON),
    "weighted_rows": ("_weighted_rows_kernel", "build", ("_weighted_rows_kernel",) + _COMMON),
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
    return kernel_sources(FAMILIES[family][2])


def key(family, spec, cc):
    """(digest, description) of a variant for compute capability `cc` ((major, minor))."""
    return variant_key(family, spec, cc, sources(family))


def compile_variant(family, spec, cc):
    """(entry name, cubin bytes) of a variant for `cc`: the one compile route (GPU misses and
    prebuild alike; works without a GPU)."""
    from . import _numba

    pyfunc, argtypes, bounds = builder(family)(spec)
    # "kernel_<family>": Nsight filters (bench/profile, run_gpu.sh) select "^kernel"
    return _numba.compile_cubin(pyfunc, argtypes, bounds, cc, name=f"kernel_{family}")


def entry(family, spec, cc, store=None):
    """The variant's cache Entry for `cc`: from the store (`store`, default the process's
    store of :func:`cache_dir`), built and stored on a miss; compiled without storing
    when the cache is off."""
    digest, desc = key(family, spec, cc)
    build = lambda: compile_variant(family, spec, cc)  # noqa: E731
    if not enabled():
        name, cubin = build()
        return Entry(name, bytes(cubin), {"key": desc})
    return (store or _store_of()).get_or_build(family, digest, desc, build)


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
    current one): a CuPy ``Function`` loaded from the variant's cubin (raw-pointer launch on
    CuPy's current stream), kept in memory per (family, spec, device); under the simulator
    (no disk cache) a simulated kernel taking NumPy arrays. Builders are imported on a miss
    only."""
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
