"""The timing harness of the kernel benchmarks (``python -m fp8blk bench`` and
bench/bench_kernels.py): the cases and their inputs, what each case runs and the bytes it moves,
the timing loops (CUDA events, host wall time), the copy bandwidth a kernel is measured against,
and the peers (torch.compile of the same formulas, torchao's Triton kernels)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .. import _arrays
from ..formats import MXFP8, Block1D, Block2D


@dataclass(frozen=True)
class Case:
    """One timed operation: ``op`` is quantize, transpose (Block2D FP8 transpose of rowwise
    data) or dequantize (to the input dtype, from the ``rowwise`` or ``columnwise`` buffers)."""

    name: str
    op: str
    recipe: object
    rowwise: bool = True
    columnwise: bool = False


CASES = [
    Case("b1d_row", "quantize", Block1D(), True, False),
    Case("b1d_col", "quantize", Block1D(), False, True),
    Case("b1d_both", "quantize", Block1D(), True, True),
    Case("b2d_row", "quantize", Block2D(), True, False),
    Case("b2d_both", "quantize", Block2D(), True, True),
    Case("mx_row", "quantize", MXFP8(), True, False),
    Case("mx_col", "quantize", MXFP8(), False, True),
    Case("mx_both", "quantize", MXFP8(), True, True),
    Case("b2d_transpose", "transpose", Block2D(), True, False),
    Case("b1d_dequant_row", "dequantize", Block1D(), True, False),
    Case("b1d_dequant_col", "dequantize", Block1D(), False, True),
    Case("b2d_dequant_row", "dequantize", Block2D(), True, False),
    Case("mx_dequant_row", "dequantize", MXFP8(), True, False),
    Case("mx_dequant_col", "dequantize", MXFP8(), False, True),
]


# -- timing ---------------------------------------------------------------------------------


def _time_events(fn, inputs, reps, inner, synchronize, events, seconds):
    """The loop of :func:`time_cupy` / :func:`time_torch`: `events()` a new (start, stop)
    pair, `seconds(start, stop)` the time between them."""
    for inp in inputs:
        fn(inp)
    synchronize()
    gpu, host = [], []
    for _ in range(reps):
        start, stop = events()
        start.record()
        t0 = time.perf_counter()
        for i in range(inner):
            fn(inputs[i % len(inputs)])
        host.append((time.perf_counter() - t0) / inner)
        stop.record()
        stop.synchronize()
        gpu.append(seconds(start, stop) / inner)
    return statistics.median(gpu), statistics.median(host), gpu


def time_cupy(fn, inputs, reps=7, inner=10):
    """(median GPU seconds per call, median host seconds per call, all GPU figures) of
    back-to-back ``fn(inputs[i % len(inputs)])`` on CuPy's current stream, after one warm-up
    call per input. GPU time from CUDA events around ``inner`` calls; host time is the wall
    time of issuing them (equal to the GPU time when the loop is host-bound)."""
    import cupy

    return _time_events(fn, inputs, reps, inner, cupy.cuda.get_current_stream().synchronize,
                        lambda: (cupy.cuda.Event(), cupy.cuda.Event()),
                        lambda a, b: cupy.cuda.get_elapsed_time(a, b) / 1e3)


def time_torch(fn, inputs, reps=7, inner=10):
    """:func:`time_cupy` for torch callables, timed with torch's CUDA events."""
    import torch

    def events():
        return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    return _time_events(fn, inputs, reps, inner, torch.cuda.synchronize, events,
                        lambda a, b: a.elapsed_time(b) / 1e3)


def time_host(fn, inputs, reps=3):
    """(best wall seconds, median wall seconds, all) of ``fn(input)`` on the CPU."""
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(inputs[r % len(inputs)])
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), times


def gpu_copy_bandwidth(nbytes, reps=7):
    """Device-to-device copy bandwidth (bytes read + written per second) of nbytes."""
    import cupy

    src = cupy.ones(nbytes, dtype=np.uint8)
    dst = cupy.empty_like(src)

    def copy(_):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3,
                                      cupy.cuda.get_current_stream().ptr)
    gpu, _, _ = time_cupy(copy, [None], reps=reps)
    return 2 * nbytes / gpu


def cpu_copy_bandwidth(nbytes, reps=3):
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best, _, _ = time_host(lambda _: np.copyto(dst, src), [None], reps=reps)
    return 2 * nbytes / best



# -- inputs, operations and byte counts -----------------------------------------------------


def _nbytes(buffers):
    return sum(int(b.nbytes) for b in buffers if b is not None)


def gpu_inputs(n, count=3, seed=0):
    """``count`` CuPy N x N bf16 arrays (uint16 bit patterns), rows spanning orders of
    magnitude, made on the GPU."""
    import cupy

    out = []
    for i in range(count):
        rs = cupy.random.RandomState(seed + i)
        x = rs.standard_normal((n, n), dtype=np.float32)
        x *= cupy.exp(rs.uniform(-3, 3, size=(n, 1))).astype(np.float32)
        out.append((x.view(np.uint32) >> 16).astype(np.uint16))  # truncated to bf16
    return out


def cpu_inputs(n, count=1, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal((n, n), dtype=np.float32)
        x *= np.exp(rng.uniform(-3, 3, size=(n, 1))).astype(np.float32)
        out.append(x)
    return out


def gpu_operation(case, inputs):
    """(fn, args list, bytes per call) for a case on the GPU kernels (``fp8blk.kernels``)."""
    from ..kernels import backend as kernels

    bf16 = _arrays.BF16
    n = inputs[0].shape
    rec, rw, cw = case.recipe, case.rowwise, case.columnwise
    if case.op == "quantize":
        out = kernels.quantize(inputs[0], rec, rw, cw, dtype=bf16)
        return (lambda x: kernels.quantize(x, rec, rw, cw, dtype=bf16),
                inputs, inputs[0].nbytes + _nbytes(out))
    if case.op == "transpose":
        rowwise = [kernels.quantize(x, rec, True, False, dtype=bf16)[:2] for x in inputs]
        out = kernels.block2d_columnwise_from_rowwise(*rowwise[0])
        return (lambda b: kernels.block2d_columnwise_from_rowwise(*b, out=out), rowwise,
                _nbytes(rowwise[0]) + _nbytes(out))
    q = kernels.quantize(inputs[0], rec, rw, cw, dtype=bf16)
    bufs = [list(q)]
    return (lambda b: kernels.dequantize(rec, n, *b, dtype=bf16), bufs,
            _nbytes(q) + inputs[0].nbytes)


def cpu_operation(case, inputs):
    """(fn, args list, bytes per call) for a case on the NumPy reference (``fb.quantize``)."""
    from ..ops import quantize

    rec, rw, cw = case.recipe, case.rowwise, case.columnwise
    if case.op == "quantize":
        q = quantize(inputs[0], rec, rw, cw)
        return (lambda x: quantize(x, rec, rw, cw), inputs, inputs[0].nbytes + _held(q))
    if case.op == "transpose":
        qs = [quantize(x, rec, True, False) for x in inputs]
        before = _held(qs[0])
        qs[0].create_columnwise()
        return (lambda q: q.create_columnwise(), qs, before + _held(qs[0]))
    q = quantize(inputs[0], rec, rw, cw)
    return (lambda q: q.dequantize(np.float32), [q], _held(q) + inputs[0].nbytes)


def _held(q):
    return _nbytes([q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data,
                    q.columnwise_scale_inv])



# -- peers (GPU only) -----------------------------------------------------------------------


def torch_formulas():
    """The Block1D / Block2D / MXFP8 quantize formulas (E4M3, pow2 scales) written in torch,
    for ``torch.compile``: {case name: fn(bf16 (M, K)) -> outputs}. M, K multiples of 128."""
    import torch

    f8 = torch.float8_e4m3fn
    pow2_mask = -8388608  # 0xFF800000 as int32: keep sign and exponent

    def scale_from_amax(amax):
        scale = torch.where(amax == 0, torch.ones_like(amax), 448.0 / amax)
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, 3.3895313892515355e38),
                            scale)
        return (scale.view(torch.int32) & pow2_mask).view(torch.float32)

    def b1d_row(x):
        m, k = x.shape
        xf = x.float().reshape(m, k // 128, 128)
        scale = scale_from_amax(xf.abs().amax(dim=-1, keepdim=True))
        y = (xf * scale).clamp(-448.0, 448.0).to(f8).reshape(m, k)
        return y, (1.0 / scale).reshape(m, k // 128).t().contiguous()

    def b1d_col(x):
        return b1d_row(x.t())

    def b1d_both(x):
        return b1d_row(x) + b1d_col(x)

    def b2d_row(x):
        m, k = x.shape
        xf = x.float().reshape(m // 128, 128, k // 128, 128)
        scale = scale_from_amax(xf.abs().amax(dim=(1, 3), keepdim=True))
        y = (xf * scale).clamp(-448.0, 448.0).to(f8).reshape(m, k)
        return y, (1.0 / scale).reshape(m // 128, k // 128)

    def b2d_both(x):
        y, s = b2d_row(x)
        return y, s, y.t().contiguous(), s.t().contiguous()

    def mx_row(x):
        m, k = x.shape
        xf = x.float().reshape(m, k // 32, 32)
        v = xf.abs().amax(dim=-1, keepdim=True) * (1.0 / 448.0)
        bits = v.view(torch.int32)
        e = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        up = (mant > 0) & (e != 0xFE) & ~((e == 0) & (mant <= 0x400000))
        code = torch.where(v == 0, torch.zeros_like(e), e + up.to(torch.int32))
        mult = torch.where(code == 0, torch.ones_like(v),
                           ((254 - code) << 23).view(torch.float32))
        y = (xf * mult).clamp(-448.0, 448.0).to(f8).reshape(m, k)
        return y, code.to(torch.uint8).reshape(m, k // 32)

    def transpose(data):
        return data.t().contiguous()

    return {"b1d_row": b1d_row, "b1d_col": b1d_col, "b1d_both": b1d_both, "b2d_row": b2d_row,
            "b2d_both": b2d_both, "mx_row": mx_row, "b2d_transpose": transpose}


def torchao_kernels():
    """{case name: fn(bf16 tensor)} of torchao's Triton kernels, or {} without torchao."""
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as tk
    except Exception:
        return {}
    row, col = tk.triton_fp8_blockwise_act_quant_lhs, \
        tk.triton_fp8_blockwise_act_quant_transposed_lhs
    w_row, w_col = tk.triton_fp8_blockwise_weight_quant_rhs, \
        tk.triton_fp8_blockwise_weight_quant_transposed_rhs
    # torchao has no fused row+col kernels: "both" is its two kernels back to back
    return {"b1d_row": row, "b1d_col": col, "b1d_both": lambda x: (row(x), col(x)),
            "b2d_row": w_row, "b2d_both": lambda x: (w_row(x), w_col(x))}
