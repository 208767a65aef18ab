"""What a launcher needs besides its kernel: the array families a launch takes (one adapter
per family: CuPy arrays, torch CUDA tensors, NumPy under the simulator; :func:`adapter_of`),
the raw launch on torch's stream, input kinds, launch-plan caches, tuning settings and scalar
arguments. Why launches go this way (no DLPack, one parameter block): docs/torch.md.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from .._arrays import (BF16, CupyFamily, HostFamily, TorchFamily, numpy_to_torch_dtype,
                       torch_module, torch_raw_stream)
from .._bounded import BoundedCache
from . import _specs as sp

# ---- inputs, plans, tuning ----------------------------------------------------------------

_KIND_OF = {np.dtype(np.float32): sp.F32, np.dtype(np.float16): sp.F16}


_KINDS = {}  # (stored dtype, logical dtype) -> kind: the per-call lookup


def kind_of(stored, dtype):
    """Input kind (sp.F32 / BF16 / F16) from the logical dtype `dtype` (None: the stored one)
    and the array's stored dtype `stored` (CuPy holds bf16 as uint16)."""
    kind = _KINDS.get((stored, dtype))
    if kind is None:
        kind = _KINDS[(stored, dtype)] = _kind_slow(stored, dtype)
    return kind


def kind_among(ad, arr, dtype, kinds):
    """The input kind of `arr` (adapter `ad`, logical ``dtype`` as :func:`kind_of`) if it is
    one of `kinds`, else None (other dtypes too)."""
    try:
        kind = kind_of(ad.dtype(arr), dtype)
    except TypeError:
        return None
    return kind if kind in kinds else None


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


# ---- array families: allocation, arguments, launch -------------------------------------------

# An adapter extends its family's class of fp8blk._arrays with a new array on the same device,
# the kernel argument for an array and the launch on the family's current stream, so a launcher
# is written once for all families and a torch tensor never crosses into CuPy (DLPack imports
# are slow). CuPy: its memory pool and stream, bf16 held as uint16. torch: one tensor per buffer
# from the caching allocator (a direction dropped later frees its memory), launched with
# cuLaunchKernel on torch's stream from a per-thread block of 8-byte parameters (the driver
# copies them during the call). NumPy (simulator): flat views typed as the kernel indexes them.
_U16 = np.dtype(np.uint16)


_MAX_ARGS = 64      # the grouped GEMMs pass their three tensor maps as 48 words


class _Params(threading.local):
    """A kernel parameter block of this thread: _MAX_ARGS uint64 slots and the array of their
    addresses that cuLaunchKernel reads."""

    def __init__(self):
        self.slots = (ctypes.c_uint64 * _MAX_ARGS)()
        base = ctypes.addressof(self.slots)
        self.addresses = (ctypes.c_void_p * _MAX_ARGS)(*[base + 8 * i for i in range(_MAX_ARGS)])
        self.address = ctypes.addressof(self.addresses)


_params = _Params()
_cuda = []  # [cupy.cuda.driver, cupy.cuda.runtime], imported on first launch


def _cupy_cuda():
    if not _cuda:
        from cupy.cuda import driver, runtime

        _cuda.extend((driver, runtime))
    return _cuda


class DriverError(RuntimeError):
    """A CUDA driver call failed; ``status`` is its CUresult (as CuPy's CUDADriverError)."""

    def __init__(self, status, what="cuLaunchKernel"):
        super().__init__(f"{what} failed: CUDA driver error {status}")
        self.status = status


_driver_launch = []  # [cuLaunchKernel bound through ctypes.PyDLL] or [None]: CuPy's then


def _bind_driver_launch():
    """libcuda's cuLaunchKernel through ``ctypes.PyDLL``: the call keeps the GIL (it only
    queues work). CuPy's launch and ctypes' CDLL calls release the GIL and take it back,
    which lets another thread in between -- autograd's device thread tearing down a Python
    node, say -- so every launch can wait for that thread."""
    fn = None
    try:
        fn = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel    # the process's driver library
        u = ctypes.c_uint
        fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        fn = None
    _driver_launch.append(fn)
    return fn


def raw_launch(kernel, grid, block, args, stream_ptr, shared_mem=0):
    """Launch compiled `kernel` (a CuPy Function) with `args`, a list of ints (pointers and
    int64 scalars, each passed as 8 bytes), on the stream `stream_ptr`, with `shared_mem`
    bytes of dynamic shared memory."""
    params = _params
    params.slots[:len(args)] = args
    launch = _driver_launch[0] if _driver_launch else _bind_driver_launch()
    if launch is not None:
        status = launch(kernel.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                        shared_mem, stream_ptr, params.address, None)
        if status:
            raise DriverError(status)
        return
    driver = (_cuda or _cupy_cuda())[0]
    driver.launchKernel(kernel.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                        shared_mem, stream_ptr, params.address, 0)


class _Launches:
    """The launch of CuPy and simulated NumPy kernels alike."""

    @staticmethod
    def launch(kernel, grid, block, args, like):
        # The compiled kernel's own call: on the GPU CuPy's Function (a Cython call converting
        # CuPy arrays to pointers, on CuPy's current stream: as fast as the raw launch and no
        # stream lookup), under the simulator the simulated kernel.
        kernel(grid, block, args)


class _Cupy(_Launches, CupyFamily):
    @staticmethod
    def empty(shape, dtype, like):
        """A new C-contiguous array; bf16 is held as uint16 bit patterns."""
        import cupy

        return cupy.empty(shape, dtype=_U16 if dtype == BF16 else dtype)

    @staticmethod
    def arg(arr, np_dtype):
        return arr.data.ptr

    @staticmethod
    def args(arrays, np_dtypes, scalars):
        """Kernel arguments: the arrays (None: the first array; CuPy passes each array's
        pointer), then `scalars`."""
        first = arrays[0]
        return tuple([first if a is None else a for a in arrays]) + scalars

    @staticmethod
    def alloc(like, nbytes, layouts, offsets):
        """Arrays of `layouts` [(shape, dtype) or None] at byte `offsets` of ONE new allocation
        of `nbytes` (one memory-pool call instead of up to four)."""
        import cupy

        mem = cupy.cuda.alloc(nbytes)
        # `mem + o` makes a new MemoryPointer object: skip it for the first buffer
        return tuple([None if s is None else cupy.ndarray(s[0], s[1], memptr=mem + o if o else mem)
                      for s, o in zip(layouts, offsets)])



class _Torch(TorchFamily):
    @staticmethod
    def empty(shape, dtype, like):
        return torch_module().empty(shape, dtype=numpy_to_torch_dtype(dtype), device=like.device)

    @staticmethod
    def arg(arr, np_dtype):
        return arr.data_ptr()

    @staticmethod
    def args(arrays, np_dtypes, scalars):
        first = arrays[0].data_ptr()
        return [first if a is None else a.data_ptr() for a in arrays] + list(scalars)

    @staticmethod
    def alloc(like, nbytes, layouts, offsets):
        """One torch tensor per buffer from the caching allocator (its blocks are 512-byte
        aligned), so that a direction dropped later frees its memory (a saved FP8 activation
        must not pin the other direction)."""
        empty, device = torch_module().empty_strided, like.device
        return tuple([None if s is None else empty(s[0], contiguous_strides(s[0]),
                                                   dtype=numpy_to_torch_dtype(s[1]),
                                                   device=device)
                      for s in layouts])

    @staticmethod
    def launch(kernel, grid, block, args, like):
        torch_launch(kernel, grid, block, args, like.get_device())


def torch_launch(kernel, grid, block, args, index, shared_mem=0):
    """Launch `kernel` with `args` (ints: pointers and int64 scalars) on torch's current stream
    of CUDA device `index` (what ``_Torch.launch`` does; the torch hot paths call it with the
    device index they keyed their plan by)."""
    runtime = (_cuda or _cupy_cuda())[1]
    stream = torch_raw_stream()(index)
    if runtime.getDevice() == index:
        launch_here(kernel, grid, block, args, stream, index, shared_mem)
    else:
        import cupy

        with cupy.cuda.Device(index):
            raw_launch(kernel, grid, block, args, stream, shared_mem)


def launch_here(kernel, grid, block, args, stream, index, shared_mem=0):
    """:func:`raw_launch` for a caller on CUDA device `index` already (the current device),
    binding the device's primary context to this thread where no CUDA runtime call has:
    autograd's worker thread for GPU 0 (torch skips cudaSetDevice when the runtime already
    reports device 0)."""
    try:
        raw_launch(kernel, grid, block, args, stream, shared_mem)
    except Exception as exc:
        if getattr(exc, "status", None) != _INVALID_CONTEXT:
            raise
        (_cuda or _cupy_cuda())[1].setDevice(index)
        raw_launch(kernel, grid, block, args, stream, shared_mem)


class LaunchSite:
    """One call site's launch of one kernel, with a parameter block of its own: the caller
    writes the call's arguments into :attr:`args` (ctypes uint64 slots: pointers and int64
    scalars, in the kernel's order) and calls :meth:`launch`. A hot path that launches the
    same kernel on every call builds no argument list and ctypes converts one value (the
    stream). The caller serializes the calls of one site (the slots are shared)::

        site = LaunchSite(kernel, grid, block, [0] * 5 + scalars, device_index)
        site.args[0] = x_ptr
        site.launch(stream)
    """

    __slots__ = ("args", "addresses", "head", "tail", "index", "kernel", "grid", "block")

    def __init__(self, kernel, grid, block, args, index):
        n = len(args)
        self.args = (ctypes.c_uint64 * n)(*args)
        base = ctypes.addressof(self.args)
        self.addresses = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.kernel, self.grid, self.block, self.index = kernel, grid, block, index
        # cuLaunchKernel's arguments around the stream, ready for a call without argtypes
        self.head = (ctypes.c_void_p(kernel.ptr),) + tuple(grid) + tuple(block) + (0,)
        self.tail = (ctypes.c_void_p(ctypes.addressof(self.addresses)), None)

    def launch(self, stream: int):
        """Launch on raw stream `stream` of the site's device (the current device)."""
        fn = _site_launch[0] if _site_launch else _bind_site_launch()
        if fn is None:
            driver = (_cuda or _cupy_cuda())[0]
            g, b = self.grid, self.block
            driver.launchKernel(self.kernel.ptr, g[0], g[1], g[2], b[0], b[1], b[2], 0,
                                stream, ctypes.addressof(self.addresses), 0)
            return
        status = fn(*self.head, ctypes.c_void_p(stream), *self.tail)
        if status:
            if status != _INVALID_CONTEXT:
                raise DriverError(status)
            # autograd's device thread with no context bound yet (:func:`launch_here`)
            (_cuda or _cupy_cuda())[1].setDevice(self.index)
            status = fn(*self.head, ctypes.c_void_p(stream), *self.tail)
            if status:
                raise DriverError(status)


_site_launch = []   # [cuLaunchKernel without argtypes (LaunchSite passes ctypes values)]


def _bind_site_launch():
    fn = None
    if (_driver_launch[0] if _driver_launch else _bind_driver_launch()) is not None:
        fn = ctypes.PyDLL("libcuda.so.1")["cuLaunchKernel"]   # a function object of its own
        fn.restype = ctypes.c_int
    _site_launch.append(fn)
    return fn


def contiguous_strides(shape):
    """C-contiguous strides, in elements, of `shape` (a tuple): what ``torch.empty_strided``
    takes, the cheapest of torch's allocating calls from Python."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


class _Sim(_Launches, HostFamily):
    @staticmethod
    def empty(shape, dtype, like):
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def arg(arr, np_dtype):
        return arr.reshape(-1).view(np_dtype)

    @staticmethod
    def args(arrays, np_dtypes, scalars):
        # an output a specialization never touches gets a small array of its pointer type
        # (a view of another array as a wider type fails when its byte size does not divide)
        return tuple([np.zeros(16, t) if a is None else a.reshape(-1).view(t)
                      for a, t in zip(arrays, np_dtypes)]) + tuple(scalars)

    @staticmethod
    def alloc(like, nbytes, layouts, offsets):
        base = np.empty(nbytes, np.uint8)
        return tuple([None if s is None else np.ndarray(s[0], s[1], buffer=base, offset=o)
                      for s, o in zip(layouts, offsets)])



CUPY_ARRAYS, TORCH_ARRAYS, SIM_ARRAYS = _Cupy, _Torch, _Sim
_BY_TYPE = {np.ndarray: _Sim}


def adapter_of(arr):
    """The adapter of an internal device array (CuPy, torch CUDA, or NumPy under the
    simulator)."""
    hit = _BY_TYPE.get(type(arr))
    if hit is not None:
        return hit
    torch = torch_module()
    if torch is not None and isinstance(arr, torch.Tensor):
        if not arr.is_cuda:
            raise TypeError("the kernels take CUDA tensors; CPU tensors use the reference")
        hit = _Torch
    else:
        hit = _Cupy
    if len(_BY_TYPE) < 16:
        _BY_TYPE[type(arr)] = hit
    return hit
