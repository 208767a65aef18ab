"""The experts' grouped GEMMs in one launch each, the launcher of ``_grouped_gemm_kernel`` and
the experts room's door to it (``fp8blk.torch.moe.gemms``), for torch CUDA tensors on a Hopper
GPU (compute capability 9.0). The segments are read on the device, so no call synchronizes
with the GPU and a CUDA graph can capture it.

:func:`forward_rows`, m-grouped: every expert's ``out[seg_e] = dequant(a[seg_e]) @
dequant(b[e]).T`` (the experts' forward and input-gradient GEMMs):

    a (rows, K) float8_e4m3fn, rows a multiple of 128, with 1x128 scales (K/128, >= rows) fp32
    b (E, N, K) float8_e4m3fn, rows contiguous, stacked along rows (b[e] at row e*N of an
      (E*N, K) matrix) or side by side along columns (b[e] at column e*K of an (N, E*K)
      matrix: expert_weight_buffers' transposed view), with 128x128 scales (E, N/128, >= K/128)
    tile_expert (rows/128,) int32: each row tile's expert, E past the last segment
    out (rows, N) bfloat16; rows of a tile past the last segment are zeros

:func:`weights`, k-grouped: every expert's ``out[e] = dequant(a_t[:, seg_e]) @
dequant(b_t[:, seg_e]).T`` (the weight gradients):

    a_t (N, rows) and b_t (K, rows) float8_e4m3fn, tokens contiguous, with 128x1 scales
      (rows/128, >= N) and (rows/128, >= K) fp32 (the columnwise buffers)
    table (3, E) int64: the routing's starts, padded lengths (multiples of 128), counts
    out (E, N, K) bfloat16, zeros for an expert without rows

:func:`serves` / :func:`serves_weights` say whether a call fits (K and N multiples of 128,
16-byte aligned rows and scales, bf16 out). The m-grouped bytes equal cuBLASLt's per-expert
``blockwise_scaled_mm`` where that sums as the kernel does (the same promotion per 128-deep
block); the k-grouped outputs are within the bound of a reordered fp32 sum (docs/torch.md,
"Experts").

    out = forward_rows(a, a_scale, b, b_scale, tile_expert)       # doctest: +SKIP
    dw = weights(a_t, a_t_scale, b_t, b_t_scale, routing.table)   # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import struct
import threading

from .._arrays import torch_module
from .._bounded import BoundedCache
from ._launch import torch_launch
from ._specs import SIM

_lock = threading.Lock()
_kernels = {}                        # (device index, kernel name) -> the compiled kernel
_maps = BoundedCache(256)            # a tensor map's arguments -> its 16 words
_devices = {}                        # device index -> (compute capability 9.0?, multiprocessors)
POLICIES = ("auto", "always", "never")
AUTO_MIN_EXPERTS = 17
_policy = ["auto"]


def set_policy(policy: str) -> str:
    """When the experts' GEMMs take the one-launch kernels, for the whole process; returns the
    previous policy. ``"auto"`` (the default): with AUTO_MIN_EXPERTS experts or more, or while
    the current stream captures a CUDA graph; with fewer experts the per-expert cuBLASLt loop
    is faster on the H200 (its GEMMs run 3-30% faster on segments of thousands of rows,
    ``bench/profile/results/probe-grouped-tma-h200.json``) at the cost of one host
    synchronization per routing. ``"always"`` / ``"never"``: wherever they serve / nowhere."""
    if policy not in POLICIES:
        raise ValueError(f"set_policy: policy must be one of {POLICIES}, got {policy!r}")
    prev = _policy[0]
    _policy[0] = policy
    return prev


def _wanted(experts) -> bool:
    policy = _policy[0]
    if policy == "auto":
        return experts >= AUTO_MIN_EXPERTS or torch_module().cuda.is_current_stream_capturing()
    return policy == "always"


def _device(index):
    info = _devices.get(index)
    if info is None:
        props = torch_module().cuda.get_device_properties(index)
        info = _devices[index] = ((props.major, props.minor) == (9, 0),
                                  props.multi_processor_count)
    return info


def _hopper(index) -> bool:
    return _device(index)[0]


def serves(a, a_scale, b, b_scale, out_dtype) -> bool:
    """Whether :func:`forward_rows` takes these operands (module docstring): CUDA tensors on
    one Hopper device, e4m3 operands, K and N multiples of 128, bf16 out, and the policy
    (:func:`set_policy`) wanting the kernel for b's expert count."""
    torch = torch_module()
    if SIM or not a.is_cuda or out_dtype != torch.bfloat16 or b.dim() != 3 \
            or not _wanted(b.shape[0]):
        return False
    e4m3 = torch.float8_e4m3fn
    if a.dtype != e4m3 or b.dtype != e4m3 or a.dim() != 2 or b.dim() != 3 \
            or a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32 \
            or a_scale.dim() != 2 or b_scale.dim() != 3:
        return False
    index = a.get_device()
    if not (b.get_device() == a_scale.get_device() == b_scale.get_device() == index) \
            or not _hopper(index):
        return False
    (rows, k), (experts, n, kb) = a.shape, b.shape
    if rows == 0 or rows % 128 or k % 128 or n % 128 or kb != k or experts == 0 \
            or not a.is_contiguous() or a.data_ptr() % 16:
        return False
    if a_scale.shape[0] != k // 128 or a_scale.shape[1] < rows or a_scale.stride(1) != 1 \
            or a_scale.stride(0) % 4 or a_scale.data_ptr() % 16:
        return False
    if b_scale.shape[0] != experts or b_scale.shape[1] != n // 128 \
            or b_scale.shape[2] < k // 128 or b_scale.stride(2) != 1:
        return False
    return _b_layout(b) is not None and b.data_ptr() % 16 == 0


def serves_weights(a_t, a_t_scale, b_t, b_t_scale, out_dtype, experts) -> bool:
    """Whether :func:`weights` takes these operands for `experts` experts (module docstring,
    :func:`set_policy`)."""
    torch = torch_module()
    if SIM or not a_t.is_cuda or out_dtype != torch.bfloat16 or not _wanted(experts):
        return False
    index = a_t.get_device()
    for d, sc in ((a_t, a_t_scale), (b_t, b_t_scale)):
        if d.dtype != torch.float8_e4m3fn or d.dim() != 2 or sc.dtype != torch.float32 \
                or sc.dim() != 2 or d.get_device() != index or sc.get_device() != index:
            return False
        if d.shape[0] % 128 or d.shape[1] % 128 or d.shape[1] == 0 or d.stride(1) != 1 \
                or d.stride(0) % 16 or d.data_ptr() % 16:
            return False
        if sc.shape[0] != d.shape[1] // 128 or sc.shape[1] < d.shape[0] or sc.stride(1) != 1 \
                or sc.stride(0) % 4 or sc.data_ptr() % 16:
            return False
    return a_t.shape[1] == b_t.shape[1] and _hopper(index)


def weights(a_t, a_t_scale, b_t, b_t_scale, table):
    """(E, N, K) bfloat16: the k-grouped GEMM of the module docstring, on torch's current
    stream of a_t's device. Call :func:`serves_weights` first; ``table`` (3, E) int64 on the
    device is trusted (segments inside [0, rows), lengths multiples of 128)."""
    torch = torch_module()
    (n, rows), k = a_t.shape, b_t.shape[0]
    experts = table.shape[1]
    index = a_t.get_device()
    table = table.contiguous()
    out = torch.empty((experts, n, k), dtype=torch.bfloat16, device=a_t.device)
    if experts == 0:
        return out
    words = (_map_words(a_t.data_ptr(), n, rows, a_t.stride(0))
             + _map_words(b_t.data_ptr(), k, rows, b_t.stride(0))
             + _map_words(out.data_ptr(), experts * n, 2 * k, 2 * k, OUT_BOX_ROWS))
    from . import _grouped_gemm_kernel as gk
    grid = _grid(index, experts * (n // 128) * (k // 128))
    ws = torch.empty((grid, gk.WS_WORDS), dtype=torch.int64, device=a_t.device)
    args = [ws.data_ptr(), *words, a_t_scale.data_ptr(), b_t_scale.data_ptr(),
            table[0].data_ptr(), table[1].data_ptr(), n, k, experts, a_t_scale.stride(0),
            b_t_scale.stride(0)]
    torch_launch(_kernel(index, "weights_kernel_fn"), (grid, 1, 1), (gk.THREADS, 1, 1), args,
                 index, gk.W_SMEM_BYTES)
    return out


def _grid(index, tiles):
    """Persistent CTAs: one per multiprocessor, at most one per tile."""
    return min(_device(index)[1], tiles)


def _b_layout(b):
    """(b_by_columns, map rows, map row bytes, row stride) of b's tensor map, or None."""
    experts, n, k = b.shape
    s0, s1, s2 = b.stride()
    if s2 != 1 or s1 % 16:
        return None
    if s1 == k and (s0 == n * k or experts == 1):        # (E*N, K): experts along rows
        return 0, experts * n, k, k
    if s0 == k and s1 == experts * k:                    # (N, E*K): experts along columns
        return 1, n, experts * k, s1
    return None


def forward_rows(a, a_scale, b, b_scale, tile_expert):
    """(rows, N) bfloat16: the m-grouped GEMM of the module docstring, on torch's current
    stream of a's device. Call :func:`serves` first; ``tile_expert`` is trusted (an expert id
    outside [0, E] reads outside b)."""
    torch = torch_module()
    rows, k = a.shape
    experts, n, _ = b.shape
    index = a.get_device()
    by_columns, b_rows, b_bytes, b_stride = _b_layout(b)
    out = torch.empty((rows, n), dtype=torch.bfloat16, device=a.device)
    words = (_map_words(a.data_ptr(), rows, k, k)
             + _map_words(b.data_ptr(), b_rows, b_bytes, b_stride)
             + _map_words(out.data_ptr(), rows, 2 * n, 2 * n, OUT_BOX_ROWS))
    from . import _grouped_gemm_kernel as gk
    grid = _grid(index, (rows // 128) * (n // 128))
    ws = torch.empty((grid, gk.WS_WORDS), dtype=torch.int64, device=a.device)
    args = [ws.data_ptr(), *words, a_scale.data_ptr(), b_scale.data_ptr(),
            tile_expert.data_ptr(), rows, n, k, experts, a_scale.stride(0), b_scale.stride(0),
            b_scale.stride(1), by_columns]
    torch_launch(_kernel(index, "kernel_fn"), (grid, 1, 1), (gk.THREADS, 1, 1), args, index,
                 gk.SMEM_BYTES)
    return out


def _kernel(index, name):
    """The compiled kernel ``name`` of ``_grouped_gemm_kernel`` on device `index` (compiled
    on first use: Numba -> sm_90a cubin, its dynamic shared memory raised to the need)."""
    kernel = _kernels.get((index, name))
    if kernel is None:
        with _lock:
            kernel = _kernels.get((index, name))
            if kernel is None:
                import cupy

                from . import _grouped_gemm_kernel as gk
                from ._numba import compile_kernel
                argtypes, smem = ((gk.ARGTYPES, gk.SMEM_BYTES) if name == "kernel_fn"
                                  else (gk.W_ARGTYPES, gk.W_SMEM_BYTES))
                with cupy.cuda.Device(index):
                    kernel = compile_kernel(getattr(gk, name), argtypes,
                                            launch_bounds=(gk.THREADS, 1))
                    cupy.cuda.driver.funcSetAttribute(
                        kernel.ptr,
                        cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                _kernels[(index, name)] = kernel
    return kernel


# ---- tensor maps ------------------------------------------------------------------------------
# cuTensorMapEncodeTiled (CUDA driver API): the kernels' copy engine reads A's and B's 128 x
# 128-byte boxes through them and writes the output's 64 x 128-byte boxes. A launch passes the
# three maps' 48 words as kernel arguments and each CTA copies them into its words of a
# workspace (the copy engine reads maps from global memory): no host-to-device copy, nothing
# to keep alive, and a CUDA graph holds them by value.
# The words of a map depend only on (address, rows, row bytes, row stride, box rows): cached.

OUT_BOX_ROWS = 64            # a math warpgroup's 64 output rows per bulk store

_encode = []


def _encoder():
    if not _encode:
        f = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _encode.append(f)
    return _encode[0]


def tensor_map(address, rows, row_bytes, stride, box_rows=128) -> bytes:
    """The 128-byte CUtensorMap of a (rows, row_bytes) uint8 matrix at `address` with `stride`
    bytes between rows: box_rows x 128-byte boxes, 128-byte swizzle, zeros outside."""
    buf = ctypes.create_string_buffer(256)
    at = (ctypes.addressof(buf) + 63) // 64 * 64             # CUtensorMap is 64-byte aligned
    dims = (ctypes.c_uint64 * 2)(row_bytes, rows)
    strides = (ctypes.c_uint64 * 1)(stride)
    box = (ctypes.c_uint32 * 2)(128, box_rows)
    step = (ctypes.c_uint32 * 2)(1, 1)
    # data type UINT8 (0), no interleave (0), 128-byte swizzle (3), L2 promotion 256 bytes (3),
    # out-of-bounds elements read as zeros (0)
    status = _encoder()(at, 0, 2, address, dims, strides, box, step, 0, 3, 3, 0)
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUDA driver error {status} for a "
                           f"({rows}, {row_bytes}) byte matrix with row stride {stride}")
    return ctypes.string_at(at, 128)


def _map_words(address, rows, row_bytes, stride, box_rows=128):
    key = (address, rows, row_bytes, stride, box_rows)
    with _lock:
        words = _maps.get(key)
    if words is None:
        words = struct.unpack("<16Q", tensor_map(*key))
        with _lock:
            _maps.put(key, words)
    return words


__all__ = ["AUTO_MIN_EXPERTS", "POLICIES", "forward_rows", "serves", "serves_weights",
           "set_policy", "tensor_map", "weights"]
