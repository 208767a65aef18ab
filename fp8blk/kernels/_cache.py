"""fp8blk's compiled-kernel cache on disk: one cubin per kernel variant, under an explicit key.

Numba's own ``cache=True`` cannot cache these kernels (its key hashes the pickled closure, in
which ``@intrinsic`` objects carry a random uuid, and its shared index file loses entries under
concurrent writers), so fp8blk keeps its own. This module does not import numba or CuPy: a
process whose kernels are all cached never imports numba.

Key (:func:`variant_key`): the kernel family, every field of its spec (all settings that
change generated code are spec fields), the target compute capability, a hash of the kernel
sources (the builder and the helper modules it uses, read as bytes once per process), the
toolchain versions (numba, numba-cuda, llvmlite, cuda-bindings, cuda-core, nvJitLink, NVVM;
the installed distributions' metadata folders, once per process) and the Python version.

Store (:class:`Store`): ``<dir>/<family>-<digest>.cubin`` holds a small JSON header (entry
name, the key, the cubin's sha256) and the cubin. Writes go to a temporary file in the same
folder, then ``os.replace``: a reader sees the old state or the whole new file, never a part.
A miss takes an exclusive ``fcntl.flock`` on ``<file>.lock`` and looks again before building,
so among processes that miss the same key at once (``mpiexec`` ranks) one builds and the others
wait and load its file. A file that fails its checks (truncated, other format, wrong hash) is
rebuilt. Each build appends one JSON line to ``<dir>/builds.log``.

Environment: ``FP8BLK_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fp8blk``, else
``~/.cache/fp8blk``); ``FP8BLK_KERNEL_CACHE=0`` turns the cache off (every process compiles).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections import namedtuple

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
    ``importlib.metadata``): one listdir per path entry, where ``importlib.metadata`` costs
    ~25 ms to import and ~1 ms per name looked up, on the cache-hit path of every process."""
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
    """The cubins of one cache folder (see the module docstring)."""

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
