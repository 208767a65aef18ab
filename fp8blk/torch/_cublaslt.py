"""Blockwise-scaled FP8 GEMMs on cuBLASLt directly (through ctypes), for the Linear's hot path.

``torch._scaled_mm`` finds cuBLASLt's algorithm again on every call
(``cublasLtMatmulAlgoGetHeuristic``), a large part of its host time per call. A
:class:`ScaledMM` asks the heuristic once per signature -- the same query torch makes, so the
same algorithm (bench/profile/probe_cublaslt_algos.py compares the picks) -- and then each
call sets the two scale pointers and runs ``cublasLtMatmul`` on torch's current stream.
tests/torch/test_cublaslt.py compares the outputs with ``torch._scaled_mm`` byte for
byte on the GPU.

Served (everything else: :func:`make` returns None and the caller keeps ``torch._scaled_mm``):
bf16, fp16 or fp32 output; E4M3/E5M2 operands; a with 1x128 scales; b with 128x128 or 1x128
scales; M, N and K multiples of 16 (cuBLAS's FP8 leading dimensions); the libcublasLt that
torch itself loaded, version 12.9 or later (the first with block scaling). Unlike
``torch._scaled_mm``, K need not be a multiple of 512: cuBLASLt reads fp8blk's scale buffers
as they are for any K-block count, including a partial last block (fp8blk's
(nt, round4(kt)) Block2D and (kt, R) Block1D buffers are what it reads, each checked
against an fp32 reference), so the callers need no zero-padded operand copies there.
Algorithms that need a workspace get one per call from torch's caching allocator on the
current stream, like any temporary of a torch op: its memory is reused in that stream's order
only, and under CUDA-graph capture it comes from the graph's private pool (a workspace cached
per stream would be shared by every graph captured on torch's default capture stream, and by
eager calls on that stream).

On by default; ``FP8BLK_CUBLASLT=0`` in the environment, or :data:`enabled` set False, turns
it off for signatures planned after that (the plan then calls ``torch._scaled_mm``).
:data:`refusals` keeps the last few reasons :func:`make` declined a signature it takes.
:func:`for_signature` keeps the answer of the last 1024 signatures used.

Operands as ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` takes them
(fp8blk/torch/scaled_mm.py): a (M, K) row-major; b (K, N) column-major; scale_a (M, K/128)
with strides (1, M); scale_b (K/128, N/128) with strides (1, round4(K/128)) for 128x128
blocks, or (K/128, N) contiguous for 1x128 ones; out (M, N) row-major. Only the data pointers
are read: any tensors over those bytes will do (e.g. fp8blk's buffers themselves). In
cuBLASLt's column-major terms out^T (N x M) = op(A) op(B) with A = b's bytes (K x N,
transposed), B = a's bytes (K x M), A's scales b's, B's scales a's.
"""
from __future__ import annotations

import ctypes as C
import os
import threading

import torch

from .. import _arrays
from .._bounded import BoundedCache

enabled = os.environ.get("FP8BLK_CUBLASLT", "1") != "0"

# cublasLt.h / cublas_api.h / library_types.h (CUDA 13, the headers of torch's nvidia wheel)
_R_32F, _R_16F, _R_16BF, _R_8F_E4M3, _R_8F_E5M2 = 0, 2, 14, 28, 29
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F, _SCALE_BLK128x128_32F = 4, 5
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_ASKED = 32 << 20          # torch's cuBLASLt workspace on Hopper: the same query

_FP8_TYPE = {torch.float8_e4m3fn: _R_8F_E4M3, torch.float8_e5m2: _R_8F_E5M2}  # cudaDataType
_OUT_TYPE = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float32: _R_32F}
_VP = C.c_void_p


class _HeuristicResult(C.Structure):
    _fields_ = [("algo", C.c_uint64 * 8), ("workspace_size", C.c_size_t),
                ("state", C.c_int), ("waves", C.c_float), ("reserved", C.c_int * 4)]


_lib = []          # [the bound library] once found, [None] when it cannot be
refusals = []      # why make() returned None for a signature it takes (the last few)
_handles = {}      # device index -> cublasLtHandle_t (an int)
_MIN_VERSION = 120900
_lock = threading.Lock()


def _refuse(why):
    refusals.append(why)
    del refusals[:-8]


def _loaded_path():
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def _library(device):
    """The libcublasLt torch loaded, with the calls used here bound, or None."""
    if _lib:
        return _lib[0]
    path = _loaded_path()
    if path is None and torch.cuda.is_available():
        # torch loads cuBLAS(Lt) on its first GEMM: run a tiny one
        with torch.cuda.device(device):
            torch.ones(16, 16, device=device).matmul(torch.ones(16, 16, device=device))
        path = _loaded_path()
    lib = None
    if path is not None:
        try:
            # PyDLL: calls keep the GIL (cublasLtMatmul only queues work); a CDLL call
            # releases it and takes it back, letting another thread in between
            lib = C.PyDLL(path)
        except OSError:
            lib = None
    if lib is not None:
        lib.cublasLtCreate.argtypes = [C.POINTER(_VP)]
        lib.cublasLtMatmulDescCreate.argtypes = [C.POINTER(_VP), C.c_int, C.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [_VP, C.c_int, _VP, C.c_size_t]
        lib.cublasLtMatrixLayoutCreate.argtypes = [C.POINTER(_VP), C.c_int, C.c_uint64,
                                                   C.c_uint64, C.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [C.POINTER(_VP)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [_VP, C.c_int, _VP, C.c_size_t]
        lib.cublasLtMatmulPreferenceDestroy.argtypes = [_VP]
        lib.cublasLtMatmulDescDestroy.argtypes = [_VP]
        lib.cublasLtMatrixLayoutDestroy.argtypes = [_VP]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [
            _VP, _VP, _VP, _VP, _VP, _VP, _VP, C.c_int, C.POINTER(_HeuristicResult),
            C.POINTER(C.c_int)]
        lib.cublasLtMatmul.argtypes = [_VP] * 14 + [C.c_size_t, _VP]
        lib.cublasLtGetVersion.restype = C.c_size_t
        if lib.cublasLtGetVersion() < _MIN_VERSION:
            lib = None
    _lib.append(lib)
    return lib


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _handle(lib, index):
    handle = _handles.get(index)
    if handle is None:
        h = _VP()
        with torch.cuda.device(index):
            _check(lib.cublasLtCreate(C.byref(h)), "cublasLtCreate")
        handle = _handles[index] = h.value
    return handle


def _set(lib, desc, attr, value, ctype):
    v = ctype(value)
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, C.byref(v), C.sizeof(v)),
           f"cublasLtMatmulDescSetAttribute({attr})")


def _layout(lib, dtype, rows, cols, ld):
    out = _VP()
    _check(lib.cublasLtMatrixLayoutCreate(C.byref(out), dtype, rows, cols, ld),
           "cublasLtMatrixLayoutCreate")
    return out.value


class _Descriptors:
    """A signature's matmul descriptor and three matrix layouts (host memory), destroyed when
    the last holder drops it: a ScaledMM, or the query that was refused or failed."""

    __slots__ = ("lib", "desc", "layouts")

    def __init__(self, lib):
        self.lib, self.desc, self.layouts = lib, None, []

    def __del__(self):
        try:
            if self.desc is not None:
                self.lib.cublasLtMatmulDescDestroy(self.desc)
            for layout in self.layouts:
                self.lib.cublasLtMatrixLayoutDestroy(layout)
        except Exception:  # noqa: BLE001  (interpreter shutdown: the library may be gone)
            pass


class ScaledMM:
    """``mm(a, b, scale_a, scale_b) -> out``: ``torch._scaled_mm(a, b, scale_a, scale_b,
    out_dtype=...)`` for one signature (see the module docstring for the operand
    layouts; the caller guarantees them: nothing is checked per call). Made by :func:`make`.
    Its cuBLASLt descriptors are freed with it.

    :meth:`own` gives a copy with descriptors of its own (the same algorithm) for one
    caller, and :meth:`run` the GEMM on raw pointers: a caller whose scale buffers stay put
    (the Linear's scratch memory, fp8blk/torch/_arena.py) then sets no descriptor attribute
    per call -- a scale pointer is set only when it differs from the last one set."""

    __slots__ = ("m", "n", "device", "index", "lib", "handle", "owned", "desc", "layouts",
                 "keep", "addrs", "slots", "lock", "empty", "stream", "current", "ws_size",
                 "out_dtype", "sig", "algo")

    def __init__(self, lib, handle, owned, algo, ws_size, m, n, device, out_dtype, sig):
        self.lib, self.handle, self.owned = lib, handle, owned
        self.desc, self.layouts = owned.desc, tuple(owned.layouts)
        self.m, self.n, self.device, self.index = m, n, device, device.index
        self.out_dtype, self.sig, self.algo = out_dtype, sig, algo
        # host memory cuBLASLt reads by address: a pointer-sized slot per scale pointer
        # (cuBLAS's A = torch's b, B = torch's a), alpha = 1, beta = 0, the algorithm; the
        # addresses are ints, the cheapest argument ctypes converts. The slots hold the
        # pointers last set on the descriptor.
        self.slots = (C.c_uint64(), C.c_uint64())
        self.keep = (C.c_float(1.0), C.c_float(0.0), algo)
        self.addrs = tuple(C.addressof(o) for o in self.slots + self.keep)
        self.lock = threading.Lock()
        self.empty = torch.empty_strided
        self.stream = _arrays.torch_raw_stream()
        self.current = torch._C._cuda_getDevice
        self.ws_size = ws_size

    def own(self):
        """A ScaledMM of the same signature and algorithm over new descriptors (no heuristic
        query): for a caller that runs it alone, so the scale pointers it sets stay set."""
        k, a_dtype, b_dtype, b_blocks, a_stride, b_stride = self.sig
        with _lock:
            owned = _descriptors(self.lib, self.m, self.n, k, a_dtype, b_dtype, b_blocks,
                                 self.out_dtype, 0, a_stride, b_stride)
        return ScaledMM(self.lib, self.handle, owned, self.algo, self.ws_size, self.m,
                        self.n, self.device, self.out_dtype, self.sig)

    def __call__(self, a, b, scale_a, scale_b, out=None):
        """The product into a new (m, n) tensor, or into `out`: C-contiguous rows of (m, n)
        in out_dtype on the device (e.g. a block of rows of a larger output; not checked)."""
        if self.current() != self.index:     # as torch's ops: run with the tensors' device
            with torch.cuda.device(self.index):
                return self(a, b, scale_a, scale_b, out)
        if out is None:
            out = self.empty((self.m, self.n), (self.n, 1), dtype=self.out_dtype,
                             device=self.device)
        ws, w_ptr = None, 0
        if self.ws_size:      # held until the GEMM is queued (module docstring)
            ws = self.empty((self.ws_size,), (1,), dtype=torch.uint8, device=self.device)
            w_ptr = ws.data_ptr()
        self.run(a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(),
                 out.data_ptr(), w_ptr, self.stream(self.index))
        return out

    def run(self, a, b, scale_a, scale_b, out, workspace, stream):
        """``__call__`` on data pointers (ints) on CUDA stream `stream`, the current device
        the signature's: out (m, n) = a @ b with `workspace` of :attr:`ws_size` bytes (any
        pointer where that is 0), held by the caller until the GEMM is queued."""
        lib, desc, (la, lb, lc) = self.lib, self.desc, self.layouts
        slot_a, slot_b = self.slots
        p_a, p_b, p_alpha, p_beta, p_algo = self.addrs
        # the scale pointers are attributes of the descriptor: set and run as one
        with self.lock:
            if slot_a.value != scale_b:
                slot_a.value = scale_b
                lib.cublasLtMatmulDescSetAttribute(desc, _DESC_A_SCALE_POINTER, p_a, 8)
            if slot_b.value != scale_a:
                slot_b.value = scale_a
                lib.cublasLtMatmulDescSetAttribute(desc, _DESC_B_SCALE_POINTER, p_b, 8)
            status = lib.cublasLtMatmul(self.handle, desc, p_alpha, b, la, a, lb, p_beta, out,
                                        lc, out, lc, p_algo, workspace or None, self.ws_size,
                                        stream)
        if status != 0:
            raise RuntimeError(f"cublasLtMatmul failed with status {status} (out {self.m} x "
                               f"{self.n} on cuda:{self.index})")


def make(m, n, k, a_dtype, b_dtype, b_blocks, out_dtype, device, a_stride=None,
         b_stride=None):
    """A :class:`ScaledMM` for out (m, n) = a (m, k) @ b (k, n) with these FP8 dtypes, b's
    blocks ``"128x128"`` or ``"1x128"`` (a's are 1x128), on CUDA `device`; None where it
    cannot serve the signature (module docstring) -- the caller then uses torch._scaled_mm.
    `a_stride` / `b_stride`: the row strides of a and of b's (n, k) bytes where they are not
    k (a slice of columns of a wider buffer: the experts' weight gradients), multiples of 16
    (the scale buffers stay packed: their strides are the module docstring's)."""
    strides = [s for s in (a_stride, b_stride) if s is not None]
    if not enabled or out_dtype not in _OUT_TYPE or a_dtype not in _FP8_TYPE \
            or b_dtype not in _FP8_TYPE or b_blocks not in ("128x128", "1x128") \
            or m % 16 or n % 16 or k % 16 or not (m and n and k) \
            or any(s % 16 or s < k for s in strides):
        return None
    try:
        return _make(m, n, k, a_dtype, b_dtype, b_blocks, device, out_dtype, a_stride,
                     b_stride)
    except RuntimeError as err:  # a cuBLASLt call refused the signature: torch's path serves it
        _refuse(str(err))
        return None


_made = BoundedCache(1024)   # signature -> its ScaledMM, or None where make() declined it
_made_lock = threading.Lock()
_DECLINED = object()


def for_signature(m, n, k, a_dtype, b_dtype, b_blocks, out_dtype, device, a_stride=None,
                  b_stride=None):
    """:func:`make`'s answer for a signature, kept: the one ScaledMM (or None) that the
    Linear's plans and ``blockwise_scaled_mm`` share, so each signature asks cuBLASLt's
    heuristic once (per setting of :data:`enabled`; the 1024 signatures used last are kept,
    an evicted ScaledMM frees its descriptors once no plan holds it)."""
    key = (m, n, k, a_dtype, b_dtype, b_blocks, out_dtype, device, enabled, a_stride, b_stride)
    with _made_lock:
        mm = _made.get(key)
    if mm is None:
        mm = make(m, n, k, a_dtype, b_dtype, b_blocks, out_dtype, device, a_stride,
                  b_stride) or _DECLINED
        with _made_lock:
            _made.put(key, mm)
    return None if mm is _DECLINED else mm


def _descriptors(lib, m, n, k, a_dtype, b_dtype, b_blocks, out_dtype, placeholder,
                 a_stride=None, b_stride=None):
    """A signature's matmul descriptor and three layouts (an owned :class:`_Descriptors`);
    the scale pointers set to `placeholder`'s address (block-scaled modes need them for the
    heuristic query too: status 7 with null ones; each call sets the real ones). `a_stride`,
    `b_stride`: the row strides (elements) of a (m, k) and of b's (n, k) bytes, k where
    None."""
    owned = _Descriptors(lib)   # freed on return unless the ScaledMM keeps it
    desc = _VP()
    _check(lib.cublasLtMatmulDescCreate(C.byref(desc), _COMPUTE_32F, _R_32F),
           "cublasLtMatmulDescCreate")
    desc = owned.desc = desc.value
    _set(lib, desc, _DESC_TRANSA, _OP_T, C.c_int32)
    _set(lib, desc, _DESC_TRANSB, _OP_N, C.c_int32)
    _set(lib, desc, _DESC_FAST_ACCUM, 0, C.c_int8)
    _set(lib, desc, _DESC_A_SCALE_MODE, _SCALE_BLK128x128_32F if b_blocks == "128x128"
         else _SCALE_VEC128_32F, C.c_int32)
    _set(lib, desc, _DESC_B_SCALE_MODE, _SCALE_VEC128_32F, C.c_int32)
    _set(lib, desc, _DESC_A_SCALE_POINTER, placeholder, C.c_uint64)
    _set(lib, desc, _DESC_B_SCALE_POINTER, placeholder, C.c_uint64)
    for dtype, rows, cols, ld in ((_FP8_TYPE[b_dtype], k, n, b_stride or k),
                                  (_FP8_TYPE[a_dtype], k, m, a_stride or k),
                                  (_OUT_TYPE[out_dtype], n, m, n)):
        owned.layouts.append(_layout(lib, dtype, rows, cols, ld))
    return owned


def _make(m, n, k, a_dtype, b_dtype, b_blocks, device, out_dtype=torch.bfloat16, a_stride=None,
          b_stride=None):
    with _lock:
        lib = _library(device)
        if lib is None:
            _refuse("no libcublasLt loaded by torch")
            return None
        handle = _handle(lib, device.index)
        placeholder = torch.empty(64, dtype=torch.float32, device=device)
        owned = _descriptors(lib, m, n, k, a_dtype, b_dtype, b_blocks, out_dtype,
                             placeholder.data_ptr(), a_stride, b_stride)
        desc = owned.desc
        la, lb, lc = owned.layouts
        pref = _VP()
        _check(lib.cublasLtMatmulPreferenceCreate(C.byref(pref)),
               "cublasLtMatmulPreferenceCreate")
        try:
            ws = C.c_uint64(_WORKSPACE_ASKED)
            lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES,
                                                     C.byref(ws), 8)
            result, count = _HeuristicResult(), C.c_int(0)
            status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 1,
                                                        C.byref(result), C.byref(count))
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
    if status != 0 or count.value < 1 or result.state != 0:
        _refuse(f"heuristic: status {status}, {count.value} algorithms, state {result.state}, "
                f"workspace {result.workspace_size} bytes")
        return None
    algo = (C.c_uint64 * 8)(*result.algo)
    return ScaledMM(lib, handle, owned, algo, result.workspace_size, m, n, device, out_dtype,
                    (k, a_dtype, b_dtype, b_blocks, a_stride, b_stride))
