"""``blockwise_scaled_mm``: the GEMM of two block-scaled FP8 operands, as the torch custom op
``torch.ops.fp8blk.blockwise_scaled_mm`` (with a fake implementation for torch.compile).

Contract: ``out (M, N) = dequant(a) @ dequant(b).T`` in fp32 accumulation, rounded to
``out_dtype`` (float32, bfloat16 or float16). Both operands are row-major (C-contiguous) with
the reduction dim K last (the "TN" form cuBLAS and ``torch._scaled_mm`` need):

=========  =====================  ====================================================
blocks     data                   scale_inv (fp8blk rowwise layout of an (R, K) tensor)
=========  =====================  ====================================================
"1x128"    (R, K) float8          fp32 (cdiv(K,128), round4(R)), entry [kb, r]   (Block1D)
"128x128"  (R, K) float8          fp32 (cdiv(R,128), round4(cdiv(K,128))) [rt, kt] (Block2D)
"1x32"     (R, K) float8          uint8 E8M0 (round128(R), round4(K/32))           (MXFP8)
=========  =====================  ====================================================

These are exactly the buffers fp8blk produces: a BlockTensor's rowwise buffers, or its
columnwise buffers for Block1D/Block2D (whose columnwise (K, M) data with 128x1 blocks is the
rowwise layout of the transpose). The data is viewed as ``torch.float8_e4m3fn`` or
``torch.float8_e5m2`` (the format it was quantized with): ``q.rowwise_data.view(
torch.float8_e4m3fn)``. The three GEMMs of a linear layer (x (M,K), W (N,K), dY (M,N)):

    y  = mm(x.rowwise   "1x128", W.rowwise    "128x128")   # (M, N)
    dx = mm(dY.rowwise  "1x128", W.columnwise "128x128")   # (M, K), W columnwise by FP8 transpose
    dW = mm(dY.columnwise "1x128", x.columnwise "1x128")   # (N, K), reduction over tokens

Every layout is checked; a wrong one raises a ValueError naming the layout needed. Nothing is
copied to fix a layout, except where noted for the CUDA path below.

CUDA: where cuBLASLt serves the signature directly (``_cublaslt``: M, N and K multiples of
16; ``FP8BLK_CUBLASLT=0`` turns it off) the GEMM runs there on fp8blk's buffers as they are
(cuBLASLt takes any K-block count and a partial last block; the same algorithm and bytes as
torch's call below where both take the signature). Else
``torch._scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=...)`` on views of the given
buffers (1x128 x 128x128 and 1x128 x 1x128 are both supported by torch >= 2.9 on sm_90).
Documented copies, only where neither can take fp8blk's layout as it is:
K % 128 != 0 (torch rejects such K: both operands are copied into K-padded zero buffers, the
scales are unchanged since the padded zeros sit inside the last block), N % 16 != 0 (rows of b
padded with zeros, the output sliced and made contiguous), and a "1x128" scale whose row
count is not a multiple of 4 (its padded stride differs from torch's; the valid part of the
scales, not the data, is copied). MXFP8 ("1x32") runs the emulation on CUDA too: torch's
1x32 path wants swizzled scales, which fp8blk does not produce.
CPU: an emulation: dequantize both operands to fp32 (exact for pow2 scales), fp32 matmul,
round to ``out_dtype``.

DTensor: no sharding strategy is registered for this op. Tensor parallelism runs it on local
shards inside :class:`~fp8blk.torch.Float8BlockLinear` (DTensor weights are unwrapped with
``to_local`` and the output re-wrapped with the placements the weight's sharding implies) and
inside fp8blk's sequence-parallel styles (``fp8blk.torch.tensor_parallel``). A DTensor
strategy is not registered because fp8blk's scale layouts pad their fast dim to a multiple
of 4 (docs/layouts.md): a scale tensor sharded along that dim is not the concatenation of the
shards' scale tensors unless every shard's row count is a multiple of 4 (and, for Block2D,
of 512 along K), so a generic sharding rule would be wrong for some shapes.

    import torch, fp8blk as fb
    from fp8blk.torch import blockwise_scaled_mm
    x, w = torch.randn(256, 384), torch.randn(320, 384)
    qx = fb.quantize(x, fb.Block1D()); qw = fb.quantize(w, fb.Block2D())
    y = blockwise_scaled_mm(qx.rowwise_data.view(torch.float8_e4m3fn), qx.rowwise_scale_inv,
                            qw.rowwise_data.view(torch.float8_e4m3fn), qw.rowwise_scale_inv,
                            "1x128", "128x128", torch.float32)       # (256, 320)
"""
from __future__ import annotations

import torch

from .._bounded import BoundedCache
from ..formats import MXFP8, Block1D, Block2D, check_mxfp8_shape, recipe_kind
from ..layout import all_layouts, cdiv, round_up
from . import _cublaslt
from .config import FP8_DTYPES, HIGH_DTYPES

BLOCKS = {"1x128": Block1D(), "128x128": Block2D(), "1x32": MXFP8()}
_BLOCKS_OF_KIND = {"Block1D": "1x128", "Block2D": "128x128", "MXFP8": "1x32"}
_SCALE_DTYPE = {"1x128": torch.float32, "128x128": torch.float32, "1x32": torch.uint8}
_SCALE_SHAPES = BoundedCache(4096)     # (blocks, rows, k) -> the scale_inv shape


def cublaslt_status() -> dict:
    """Which GEMM backend the Linear's plans use: ``{"enabled": bool}`` (cuBLASLt called
    directly; ``FP8BLK_CUBLASLT=0`` turns it off) and ``"refusals"``, the last few reasons
    cuBLASLt gave for declining a signature (those GEMMs run on torch._scaled_mm)."""
    return {"enabled": _cublaslt.enabled, "refusals": list(_cublaslt.refusals)}


def blocks_of(recipe) -> str:
    """The ``blocks`` argument naming a recipe's rowwise buffers: "1x128" (Block1D),
    "128x128" (Block2D), "1x32" (MXFP8)."""
    return _BLOCKS_OF_KIND[recipe_kind(recipe)]


def _scale_shape(blocks, rows, k):
    key = (blocks, rows, k)
    shape = _SCALE_SHAPES.get(key)
    if shape is None:
        shape = _SCALE_SHAPES.put(key, tuple(all_layouts(BLOCKS[blocks], rows, k)[1].shape))
    return shape


def _fast_ok(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype):
    """True when every check of check_operands passes (a few attribute reads: host time)."""
    try:
        return (a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES and out_dtype in HIGH_DTYPES
                and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1]
                and a.is_contiguous() and b.is_contiguous() and a.device == b.device
                and a_blocks != "1x32" and b_blocks != "1x32"
                and a_scale_inv.dtype == torch.float32 and b_scale_inv.dtype == torch.float32
                and a_scale_inv.is_contiguous() and b_scale_inv.is_contiguous()
                and a_scale_inv.device == a.device and b_scale_inv.device == a.device
                and tuple(a_scale_inv.shape) == _scale_shape(a_blocks, *a.shape)
                and tuple(b_scale_inv.shape) == _scale_shape(b_blocks, *b.shape))
    except (AttributeError, KeyError, TypeError):   # (KeyError: unknown blocks, or an entry
        # another thread evicted between the cache's lookup and its reordering)
        return False


def check_operands(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype):
    """Raise a ValueError/TypeError naming the layout needed if the operands do not follow the
    contract in the module docstring."""
    # (traced, the checks below run: dynamo need not trace the fast check's shape cache)
    if not torch.compiler.is_compiling() and _fast_ok(a, a_scale_inv, b, b_scale_inv,
                                                       a_blocks, b_blocks, out_dtype):
        return
    for name, blocks in (("a_blocks", a_blocks), ("b_blocks", b_blocks)):
        if blocks not in BLOCKS:
            raise ValueError(f"blockwise_scaled_mm: {name} must be one of {sorted(BLOCKS)}, "
                             f"got {blocks!r}")
    if ("1x32" in (a_blocks, b_blocks)) and a_blocks != b_blocks:
        raise ValueError(f"blockwise_scaled_mm: 1x32 (MXFP8) blocks pair only with 1x32, got "
                         f"a_blocks={a_blocks!r}, b_blocks={b_blocks!r}")
    if out_dtype not in HIGH_DTYPES:
        raise TypeError(f"blockwise_scaled_mm: out_dtype must be torch.float32, bfloat16 or "
                        f"float16, got {out_dtype}")
    for name, t in (("a", a), ("b", b), ("a_scale_inv", a_scale_inv),
                    ("b_scale_inv", b_scale_inv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"blockwise_scaled_mm: {name} must be a torch.Tensor, got "
                            f"{type(t).__module__}.{type(t).__name__}")
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(f"blockwise_scaled_mm: {name} must be a 2-D tensor (rows, K), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in FP8_DTYPES:
            hint = (f" (view the uint8 bytes as the format they hold: {name}.view("
                    f"torch.float8_e4m3fn) or torch.float8_e5m2)" if t.dtype == torch.uint8
                    else "")
            raise TypeError(f"blockwise_scaled_mm: {name} must be torch.float8_e4m3fn or "
                            f"torch.float8_e5m2, got {t.dtype}{hint}")
        if not t.is_contiguous():
            raise ValueError(f"blockwise_scaled_mm: {name} must be row-major (C-contiguous) "
                             f"(rows, K) with K the reduction dim, got strides {t.stride()}: "
                             f"pass the BlockTensor's buffer itself (for the transposed "
                             f"operand use its columnwise buffer, not .t() of the rowwise one)")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"blockwise_scaled_mm: a (rows, K) and b (cols, K) must share K (out = "
                         f"a @ b.T), got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"blockwise_scaled_mm: a is on {a.device}, b on {b.device}")
    for name, data, sinv, blocks in (("a", a, a_scale_inv, a_blocks),
                                     ("b", b, b_scale_inv, b_blocks)):
        rows, k = data.shape
        check_mxfp8_shape(BLOCKS[blocks], rows, k, f"blockwise_scaled_mm's operand {name}")
        want = all_layouts(BLOCKS[blocks], rows, k)[1].shape
        dtype = _SCALE_DTYPE[blocks]
        if (not isinstance(sinv, torch.Tensor) or tuple(sinv.shape) != tuple(want)
                or sinv.dtype != dtype or not sinv.is_contiguous()
                or sinv.device != data.device):
            got = (f"{sinv.dtype}{tuple(sinv.shape)} strides {sinv.stride()} on {sinv.device}"
                   if isinstance(sinv, torch.Tensor) else type(sinv).__name__)
            raise ValueError(
                f"blockwise_scaled_mm: {name}_scale_inv for {blocks} blocks of a "
                f"{tuple(data.shape)} operand must be fp8blk's "
                f"{type(BLOCKS[blocks]).__name__} rowwise scale layout: contiguous "
                f"{dtype}{tuple(want)} on {data.device}; got {got}")


def dequantize_operand(data, sinv, blocks):
    """fp32 values (rows, K) of an operand: FP8 ``data`` (rows, K) (float8 or its uint8 bytes
    viewed as float8 by the caller) and its ``sinv`` in the rowwise layout of ``blocks``
    ("1x128", "128x128" or "1x32"): the CPU emulation, the MXFP8 path, the expert-parallel
    dispatch's columnwise copy. Exact (each product of an FP8 value and a power-of-two or
    fp32 scale is one fp32 rounding)."""
    rows, k = data.shape
    v = data.float()
    if blocks == "1x128":
        s = sinv[:, :rows].t().repeat_interleave(128, dim=1)[:, :k]
    elif blocks == "128x128":
        s = sinv[:, :cdiv(k, 128)].repeat_interleave(128, dim=0)[:rows]
        s = s.repeat_interleave(128, dim=1)[:, :k]
    else:
        codes = sinv[:rows, : k // 32].to(torch.int32)
        s = torch.ldexp(torch.ones(codes.shape, device=data.device), codes - 127)
        s = torch.where(codes == 255, torch.full_like(s, float("nan")), s)
        s = s.repeat_interleave(32, dim=1)
    return v * s


def emulate(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype):
    """dequantize both, fp32 matmul, round to out_dtype."""
    out = (dequantize_operand(a, a_scale_inv, a_blocks)
           @ dequantize_operand(b, b_scale_inv, b_blocks).t())
    return out.to(out_dtype)


def _pad_cols(data, cols):
    # zero FP8 bytes are +0.0 in both formats: padding K contributes nothing to the sums
    out = torch.zeros((data.shape[0], cols), dtype=torch.uint8, device=data.device)
    out[:, : data.shape[1]] = data.view(torch.uint8)
    return out.view(data.dtype)


def _pad_rows(data, rows):
    out = torch.zeros((rows, data.shape[1]), dtype=torch.uint8, device=data.device)
    out[: data.shape[0]] = data.view(torch.uint8)
    return out.view(data.dtype)


def _scale_1x128(sinv, rows, padded_rows, kblocks):
    """torch's 1x128 scale for an operand of ``padded_rows`` rows and ``kblocks`` K-blocks:
    (padded_rows, kblocks) with strides (1, padded_rows). fp8blk's (kb, round4(rows)) buffer is
    that view when it has that shape already; otherwise the valid part is copied into ones
    (padded rows and K-blocks hold zero data, so their scale only has to be finite)."""
    if tuple(sinv.shape) == (kblocks, padded_rows):
        return sinv.t()
    s = torch.ones((kblocks, padded_rows), dtype=sinv.dtype, device=sinv.device)
    s[: sinv.shape[0], :rows] = sinv[:, :rows]
    return s.t()


def cuda_scaled_mm(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype):
    """The CUDA implementation: cuBLASLt directly where it serves the signature (module
    docstring; the same algorithm torch._scaled_mm picks, without its per-call search), else
    ``torch._scaled_mm`` on views of fp8blk's buffers.

    Shapes torch 2.11's blockwise path takes as they are: M % 4 == 0 (the 1x128 scales' row
    stride must be 16-byte aligned), N % 16 == 0, and K a multiple of 512 (K-block count a
    multiple of 4: on sm_90 a 128x128 scale tensor whose K-block count is not a multiple of 4
    gives wrong results with the padded row stride, and torch rejects others).
    Other shapes are zero-padded first (a copy of the operands: padded rows and K hold zero
    bytes, their scales 1.0) and the result is cropped."""
    if a_blocks == "1x32":
        return emulate(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype)
    if a_blocks != "1x128":
        raise NotImplementedError(f"blockwise_scaled_mm on CUDA takes a_blocks='1x128' "
                                  f"(torch._scaled_mm's layouts), got {a_blocks!r}")
    m, k = a.shape
    n = b.shape[0]
    kt4 = round_up(cdiv(k, 128), 4)
    kp, mp, np_ = kt4 * 128, round_up(m, 4), round_up(n, 16)
    if a.is_cuda:
        direct = _cublaslt.for_signature(m, n, k, a.dtype, b.dtype, b_blocks, out_dtype,
                                         a.device)
        if direct is not None:      # fp8blk's buffers are the layouts it reads (_cublaslt)
            return direct(a, b.t(), a_scale_inv, b_scale_inv)
    if kp != k:
        a, b = _pad_cols(a, kp), _pad_cols(b, kp)
    if mp != m:
        a = _pad_rows(a, mp)
    if np_ != n:
        b = _pad_rows(b, np_)
    scale_a = _scale_1x128(a_scale_inv, m, mp, kt4)
    if b_blocks == "128x128":
        # (kt4, nt) view of fp8blk's (nt, round4(kt)) buffer, whose padding K-blocks hold 1.0
        scale_b = b_scale_inv.t()
    else:
        scale_b = _scale_1x128(b_scale_inv, n, np_, kt4).t()
    out = torch._scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=out_dtype)
    if mp != m or np_ != n:
        out = out[:m, :n].contiguous()
    return out


@torch.library.custom_op("fp8blk::blockwise_scaled_mm", mutates_args=())
def _blockwise_scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                         b_scale_inv: torch.Tensor, a_blocks: str, b_blocks: str,
                         out_dtype: torch.dtype) -> torch.Tensor:
    check_operands(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype)
    impl = cuda_scaled_mm if a.is_cuda else emulate
    return impl(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype)


@_blockwise_scaled_mm.register_fake
def _blockwise_scaled_mm_fake(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype):
    check_operands(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def blockwise_scaled_mm(a, a_scale_inv, b, b_scale_inv, a_blocks="1x128", b_blocks="128x128",
                        out_dtype=torch.bfloat16):
    """``dequant(a) @ dequant(b).T`` (M, N) in ``out_dtype``; see the module docstring for the
    layouts. Validates first (clear errors before any dispatch). Under torch.compile it calls
    the custom op; in eager mode its implementation directly (a Python custom op's dispatch
    costs tens of microseconds of host time)."""
    check_operands(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype)
    if torch.compiler.is_compiling():
        return torch.ops.fp8blk.blockwise_scaled_mm(a, a_scale_inv, b, b_scale_inv, a_blocks,
                                                    b_blocks, out_dtype)
    impl = cuda_scaled_mm if a.is_cuda else emulate
    return impl(a, a_scale_inv, b, b_scale_inv, a_blocks, b_blocks, out_dtype)


__all__ = ["blockwise_scaled_mm", "check_operands", "emulate", "dequantize_operand", "BLOCKS",
           "blocks_of"]
