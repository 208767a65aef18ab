"""The experts' grouped GEMMs in block-scaled FP8: E weight matrices applied to the segments
of the padded token layout (``routing``), one GEMM per expert.

    grouped_mm_rows     out[seg_e] = a[seg_e] @ b[e].T     m-grouped: a 1x128, b 128x128
    grouped_mm_weights  out[e] = a_t[:, seg_e] @ b_t[:, seg_e].T  k-grouped: 128x1 operands
    grouped_row_sums    out[e] = the expert's routed rows summed (a bias gradient)

:func:`expert_weight_buffers` gives a 3-D expert weight's Block2D operands: W (E, N, K)
quantized 128x128 per expert (one quantize of the stacked (E*N, K) when N is a multiple of
128, whose tiles never cross two experts), and W_e.T from one columnwise quantize of that
stack, read in place (expert e's (K, N) is a column range of the (K, E*N) bytes).

On a Hopper GPU each grouped GEMM runs in one launch for all experts when it can and the
policy wants it (``fp8blk.kernels.grouped_gemm``: bf16 out, K and N multiples of 128, no bias
for the m-grouped one; by default with 17 experts or more, or under CUDA-graph capture),
reading the segments on the device -- no host synchronization. Otherwise the GEMMs run per
expert: on CUDA as cuBLASLt calls on addresses inside the grouped buffers
(the direct loops below), elsewhere and where cuBLASLt declines a signature through
:func:`~fp8blk.torch.blockwise_scaled_mm` (the emulation on the CPU); either way each expert's
output is the dense ``Float8BlockLinear``'s on its rows. Eager calls read the segment table
on the host once per routing (``Routing.host``); under torch.compile each loop is a custom op
(``torch.ops.fp8blk.grouped_mm_rows``, ``grouped_mm_weights``, ``grouped_row_sums``) that
reads the table itself, so a compiled layer has no graph break. The layer built on them:
``fp8blk.torch.moe.grouped``.

    import torch
    from fp8blk.torch import Float8BlockConfig
    from fp8blk.torch.linear.functional import quantize_buffers
    from fp8blk.torch.moe.routing import route, permute
    from fp8blk.torch.moe.gemms import expert_weight_buffers, grouped_mm_rows
    r = route(torch.randint(0, 4, (64, 2)), num_experts=4)
    cfg = Float8BlockConfig()
    qx = quantize_buffers(permute(torch.randn(64, 256), r), cfg.activation, True, False)
    wd, ws = expert_weight_buffers(torch.randn(4, 384, 256), cfg.weight, False, True)
    y = grouped_mm_rows(qx[0].view(torch.float8_e4m3fn), qx[1], wd, ws, r, torch.float32)
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _arrays
from ...kernels import grouped_gemm
from .. import _cublaslt
from ..config import HIGH_DTYPES, fp8_dtype
from ..linear.functional import add_bias, quantize_buffers
from ..scaled_mm import blockwise_scaled_mm
from .routing import ALIGN, Routing, gather_rows, host_table, tile_experts
from ...formats import recipe_from_key, recipe_key
from ...layout import all_layouts, cdiv

_compiling = torch.compiler.is_compiling
_raw_stream = _arrays.torch_raw_stream


def _scale_transposed(scale, recipe, rows, cols):
    """Per-expert Block2D rowwise scales (E, rt, round4(ct)) of (rows, cols) weights as their
    columnwise scales (E, ct, round4(rt)): the transposed tiles' (``fp8blk.layout``'s shape
    and padding value)."""
    lay = all_layouts(recipe, rows, cols)[3]
    ct, rt = lay.shape[0], cdiv(rows, ALIGN)
    out = scale.new_full((scale.shape[0], *lay.shape), lay.fill)
    out[:, :, :rt] = scale[:, :rt, :ct].transpose(1, 2)
    return out


def _checked_weight(weight):
    w = weight.detach()
    if w.dtype not in HIGH_DTYPES:
        raise TypeError(f"experts: weight dtype must be float32, bfloat16 or float16, got "
                        f"{w.dtype}")
    return w


def _stored(q, recipe, e, r):
    """The stacked (E*R, C) quantize's rowwise buffers as (E, R, C) data and per-expert
    scales: the stored orientation."""
    return (q[0].view(e, r, q[0].shape[1]).view(fp8_dtype(recipe.fmt)),
            q[1].view(e, -1, q[1].shape[1]))


def _stored_transposed(q, recipe, e, r, c):
    """The stacked (E*R, C) quantize's columnwise buffers read in place as every expert's
    transpose (C, R): expert e's is columns [e*R, (e+1)*R) of the (C, E*R) data, a view with
    row stride E*R (cuBLASLt and the kernels take it as it is), with its own scales."""
    rt = cdiv(r, ALIGN)
    data = q[2].view(c, e, r).transpose(0, 1)
    lay = all_layouts(recipe, r, c)[3]              # one expert's (ct, round4(rt))
    scale = q[3].new_full((e, *lay.shape), lay.fill)
    scale[:, :, :rt] = q[3][:, :e * rt].view(lay.shape[0], e, rt).transpose(0, 1)
    return data.view(fp8_dtype(recipe.fmt)), scale


def expert_weight_buffers(weight: torch.Tensor, recipe, transposed: bool, rows_first: bool):
    """A 3-D expert weight's Block2D buffers, per expert: ``(data (E, R, C) float8, scale_inv
    (E, cdiv(R,128), round4(cdiv(C,128))) fp32)``, each expert's bytes equal to
    ``fb.quantize(W_e, recipe)``'s. ``weight`` is (E, N, K) (``transposed=False``) or
    (E, K, N) (``transposed=True``, as gpt-oss stores it); ``rows_first`` asks for W_e (N, K)
    (the forward operand), else W_e.T (K, N) (the input gradient's). The data's rows are
    contiguous (stride 1 along C); its experts and rows may be strided (the transpose of the
    stored orientation, when the stored rows are a multiple of 128 or E is 1, is a view of
    one columnwise quantize: row stride E*R)."""
    w = _checked_weight(weight)
    e, r, c = w.shape
    stored = rows_first == (not transposed)     # the stored orientation is the one asked for
    if r % ALIGN == 0 or e == 1:
        # one quantize of the stacked (E*R, C); the transpose from its columnwise buffers read
        # in place, instead of a rowwise quantize and a byte transpose of all E*R*C bytes
        q = quantize_buffers(w.reshape(e * r, c).contiguous(), recipe, stored, not stored)
        return _stored(q, recipe, e, r) if stored else _stored_transposed(q, recipe, e, r, c)
    qs = [quantize_buffers(w[i].contiguous(), recipe, True, False) for i in range(e)]
    data = torch.stack([q[0] for q in qs])
    scale = torch.stack([q[1] for q in qs])
    if stored:
        return data.view(fp8_dtype(recipe.fmt)), scale
    data_t = data.transpose(1, 2).contiguous()
    return data_t.view(fp8_dtype(recipe.fmt)), _scale_transposed(scale, recipe, r, c)


def expert_weight_both(weight: torch.Tensor, recipe, transposed: bool):
    """``(expert_weight_buffers(weight, recipe, transposed, True), expert_weight_buffers(
    weight, recipe, transposed, False))``, the same bytes, from one quantize of the stacked
    weight writing both directions where the stored rows are a multiple of 128 (or E is 1):
    W read once instead of twice (the fused node's backward pass needs W_e for the
    recomputation and W_e.T for the input gradient)."""
    w = _checked_weight(weight)
    e, r, c = w.shape
    if not (r % ALIGN == 0 or e == 1):
        return (expert_weight_buffers(weight, recipe, transposed, True),
                expert_weight_buffers(weight, recipe, transposed, False))
    q = quantize_buffers(w.reshape(e * r, c).contiguous(), recipe, True, True)
    pair = (_stored(q, recipe, e, r), _stored_transposed(q, recipe, e, r, c))
    return pair[::-1] if transposed else pair


def _rows_impl(a, a_scale, b, b_scale, out_dtype, bias, table, host, tiles):
    """:func:`grouped_mm_rows` on the routing ``table`` (3, E): in one kernel launch where
    ``fp8blk.kernels.grouped_gemm`` serves it (no bias), ``tiles()`` giving the row tiles'
    experts on the device; else per expert on the segments ``host()`` (read on first need)."""
    if bias is None and grouped_gemm.serves(a, a_scale, b, b_scale, out_dtype):
        return grouped_gemm.forward_rows(a, a_scale, b, b_scale, tiles())
    host = host()
    out = _direct_rows(a, a_scale, b, b_scale, host, table, out_dtype)
    if out is None:
        out = torch.zeros((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
        for e, (start, n, _) in enumerate(host):
            if n:
                rows = slice(start, start + n)
                out[rows] = blockwise_scaled_mm(a[rows], a_scale[:, rows].contiguous(),
                                                b[e].contiguous(), b_scale[e], "1x128",
                                                "128x128", out_dtype)
    if bias is not None:
        for e, (start, _, count) in enumerate(host):
            if count:
                routed = slice(start, start + count)
                out[routed] = add_bias(out[routed], bias[e])
    return out


def _weights_impl(a_t, a_t_scale, b_t, b_t_scale, out_dtype, table, host):
    """:func:`grouped_mm_weights` on the routing ``table`` (3, E): in one kernel launch where
    ``fp8blk.kernels.grouped_gemm`` serves it, else per expert on the segments ``host()``."""
    if grouped_gemm.serves_weights(a_t, a_t_scale, b_t, b_t_scale, out_dtype, table.shape[1]):
        return grouped_gemm.weights(a_t, a_t_scale, b_t, b_t_scale, table)
    host = host()
    out = _direct_weights(a_t, a_t_scale, b_t, b_t_scale, host, out_dtype)
    if out is not None:
        return out
    out = torch.empty((len(host), a_t.shape[0], b_t.shape[0]), dtype=out_dtype,
                      device=a_t.device)
    for e, (start, n, _) in enumerate(host):
        if not n:
            out[e].zero_()
            continue
        rows, blocks = slice(start, start + n), slice(start // ALIGN, (start + n) // ALIGN)
        out[e] = blockwise_scaled_mm(a_t[:, rows].contiguous(), a_t_scale[blocks],
                                     b_t[:, rows].contiguous(), b_t_scale[blocks], "1x128",
                                     "1x128", out_dtype)
    return out


# The per-expert loops on cuBLASLt directly (CUDA, every expert's signature served): each
# expert's operands and output rows are addresses inside the grouped buffers -- no slices, no
# copies, no per-expert allocation -- and its GEMM a ScaledMM.run on them, the same GEMM on
# the same bytes as blockwise_scaled_mm's. The m-grouped GEMMs' 1x128 scales are the one
# exception: cuBLASLt reads an operand's scales with that operand's row count as their
# stride, and an expert's rows are a column range of the (kt, rows) scale buffer, so one
# gather lays every expert's block out packed first. The k-grouped GEMMs read their
# operands' columns in place (a row stride of all the rows) and their 128x1 scales are
# whole rows of the scale buffers.

def _on_device(*tensors):
    """Whether the direct loops can run on these tensors: CUDA, contiguous, on the current
    device."""
    t = tensors[0]
    return (t.is_cuda and torch.cuda.current_device() == t.device.index
            and all(x.is_contiguous() for x in tensors))


def _served(sigs, make):
    """{key: ScaledMM} for every key of `sigs` (make(key) -> ScaledMM or None), or None when
    cuBLASLt declines one of them."""
    mms = {}
    for key in sigs:
        if key not in mms:
            mm = make(key)
            if mm is None:
                return None
            mms[key] = mm
    return mms


def _workspace(mms, device):
    size = max(mm.ws_size for mm in mms.values())
    ws = torch.empty((max(size, 1),), dtype=torch.uint8, device=device)
    return ws, ws.data_ptr()


def packed_row_scales(a_scale, table, end):
    """A (kt, R) 1x128 scale buffer's columns per expert, packed: expert e's (kt, n_e) block
    row-major at element kt * start_e (fp32, (kt * end,)); ``table`` the routing's (3, E)
    device table (starts, padded lengths, counts), whose segments tile rows [0, end)."""
    kt, stride = a_scale.shape[0], a_scale.stride(0)
    starts, lengths = table[0], table[1]
    p = torch.arange(kt * end, device=a_scale.device)
    seg = torch.searchsorted(starts * kt, p, right=True) - 1   # an empty expert's start is
    start, n = starts[seg], lengths[seg]                      # its successor's: the last wins
    q = p - kt * start
    return a_scale.reshape(-1)[q // n * stride + start + q % n]


def _direct_rows(a, a_scale, b, b_scale, host, table, out_dtype):
    """:func:`_rows_impl`'s GEMMs (without the bias) on cuBLASLt directly, or None where that
    cannot serve them."""
    # b's rows may be strided (expert_weight_buffers' transposed view): cuBLASLt's b_stride
    if not _on_device(a, a_scale, b_scale) or b.stride(2) != 1 \
            or b.get_device() != a.get_device():
        return None
    (rows, k), n_out, dev = a.shape, b.shape[1], a.device
    b_stride = None if b.stride(1) == k else b.stride(1)
    segs = [(e, start, n) for e, (start, n, _) in enumerate(host) if n]
    ends = [start + n for _, start, n in segs]
    if segs and segs[0][1] or any(start != end for (_, start, _), end in zip(segs[1:], ends)):
        return None                                 # segments not tiling the rows
    mms = _served([n for _, _, n in segs], lambda n: _cublaslt.for_signature(
        n, n_out, k, a.dtype, b.dtype, "128x128", out_dtype, dev, b_stride=b_stride))
    if mms is None:
        return None
    out = torch.zeros((rows, n_out), dtype=out_dtype, device=dev)
    if not segs:
        return out
    kt = a_scale.shape[0]
    scales = packed_row_scales(a_scale, table, ends[-1])
    ws, w_p = _workspace(mms, dev)
    stream = _raw_stream()(dev.index)
    a_p, b_p, s_p, bs_p, o_p = (t.data_ptr() for t in (a, b, scales, b_scale, out))
    b_step, bs_step, o_row = b.stride(0), b_scale.stride(0) * 4, n_out * out.element_size()
    for e, start, n in segs:
        mms[n].run(a_p + start * k, b_p + e * b_step, s_p + 4 * kt * start, bs_p + e * bs_step,
                   o_p + start * o_row, w_p, stream)
    return out


def _direct_weights(a_t, a_t_scale, b_t, b_t_scale, host, out_dtype):
    """:func:`_weights_impl` on cuBLASLt directly, or None where that cannot serve it."""
    if not _on_device(a_t, a_t_scale, b_t, b_t_scale):
        return None
    (n_a, rows), n_b, dev = a_t.shape, b_t.shape[0], a_t.device
    segs = [(e, start, n) for e, (start, n, _) in enumerate(host) if n]
    mms = _served([n for _, _, n in segs], lambda n: _cublaslt.for_signature(
        n_a, n_b, n, a_t.dtype, b_t.dtype, "1x128", out_dtype, dev, a_stride=rows,
        b_stride=rows))
    if mms is None:
        return None
    out = torch.empty((len(host), n_a, n_b), dtype=out_dtype, device=dev)
    empty = [e for e, (_, n, _) in enumerate(host) if not n]
    if empty:                   # an expert without rows gets a zero gradient (one fill)
        out[empty] = 0
    if not segs:
        return out
    ws, w_p = _workspace(mms, dev)
    stream = _raw_stream()(dev.index)
    a_p, as_p, b_p, bs_p, o_p = (t.data_ptr() for t in (a_t, a_t_scale, b_t, b_t_scale, out))
    as_row, bs_row = a_t_scale.stride(0) * 4, b_t_scale.stride(0) * 4
    o_step = n_a * n_b * out.element_size()
    for e, start, n in segs:
        block = start // ALIGN
        mms[n].run(a_p + start, b_p + start, as_p + block * as_row, bs_p + block * bs_row,
                   o_p + e * o_step, w_p, stream)
    return out


def _row_sums_impl(dy, host):
    out = dy.new_zeros((len(host), dy.shape[1]))
    for e, (start, _, count) in enumerate(host):
        if count:
            out[e] = dy[start:start + count].sum(0)
    return out


# The per-expert loops as torch custom ops: under torch.compile the segment table is read
# inside the op (dynamo sees no data-dependent Python), in eager mode the implementations run
# directly with the routing's cached table (one read per routing, not per GEMM).
@torch.library.custom_op("fp8blk::grouped_mm_rows", mutates_args=())
def _rows_op(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             table: torch.Tensor, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _rows_impl(a, a_scale, b, b_scale, out_dtype, bias, table, lambda: host_table(table),
                      lambda: tile_experts(table[1], a.shape[0]))


@_rows_op.register_fake
def _rows_fake(a, a_scale, b, b_scale, table, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("fp8blk::grouped_mm_weights", mutates_args=())
def _weights_op(a_t: torch.Tensor, a_t_scale: torch.Tensor, b_t: torch.Tensor,
                b_t_scale: torch.Tensor, table: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    return _weights_impl(a_t, a_t_scale, b_t, b_t_scale, out_dtype, table,
                         lambda: host_table(table))


@_weights_op.register_fake
def _weights_fake(a_t, a_t_scale, b_t, b_t_scale, table, out_dtype):
    return a_t.new_empty((table.shape[1], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)


def _weights_tokens_impl(a_t, a_t_scale, hidden, sources, recipe, out_dtype, table, host):
    """:func:`grouped_mm_weights` with b_t the columnwise buffers of the tokens' permuted
    rows ``gather_rows(hidden, sources)``, quantized here."""
    b_t, b_t_scale = quantize_buffers(gather_rows(hidden, sources), recipe, False, True)[2:]
    return _weights_impl(a_t, a_t_scale, b_t.view(fp8_dtype(recipe.fmt)), b_t_scale,
                         out_dtype, table, host)


# the permuted rows' quantization inside the op that reads dY: as an op of its own, reading
# forward inputs alone, the partitioner would run it in the forward pass and keep its output
# (fp8blk.torch.linear.compiled's linear_bwd_x, for the same reason)
@torch.library.custom_op("fp8blk::grouped_mm_weights_tokens", mutates_args=())
def _weights_tokens_op(a_t: torch.Tensor, a_t_scale: torch.Tensor, hidden: torch.Tensor,
                       sources: torch.Tensor, recipe: str, table: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    return _weights_tokens_impl(a_t, a_t_scale, hidden, sources, recipe_from_key(recipe),
                                out_dtype, table, lambda: host_table(table))


@_weights_tokens_op.register_fake
def _weights_tokens_fake(a_t, a_t_scale, hidden, sources, recipe, table, out_dtype):
    return a_t.new_empty((table.shape[1], a_t.shape[0], hidden.shape[1]), dtype=out_dtype)


@torch.library.custom_op("fp8blk::grouped_row_sums", mutates_args=())
def _row_sums_op(dy: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return _row_sums_impl(dy, host_table(table))


@_row_sums_op.register_fake
def _row_sums_fake(dy, table):
    return dy.new_empty((table.shape[1], dy.shape[1]))


def grouped_mm_rows(a, a_scale, b, b_scale, routing: Routing, out_dtype, bias=None):
    """m-grouped: ``out[seg_e] = dequant(a[seg_e]) @ dequant(b[e]).T`` for every expert;
    ``a`` (rows, K) float8 with 1x128 scales (cdiv(K,128), rows), ``b`` (E, N, K) float8 with
    128x128 scales (E, ...). ``bias`` (E, N) or None: ``bias[e]`` rounded to ``out_dtype`` and
    added to the expert's routed rows (``add_bias``), not to its padding rows. Rows outside
    the routed rows are zero."""
    if _compiling():
        return torch.ops.fp8blk.grouped_mm_rows(a, a_scale, b, b_scale, routing.table,
                                                out_dtype, bias)
    return _rows_impl(a, a_scale, b, b_scale, out_dtype, bias, routing.table, routing.host,
                      routing.tile_experts)


def grouped_mm_weights(a_t, a_t_scale, b_t, b_t_scale, routing: Routing, out_dtype):
    """k-grouped: ``out[e] = dequant(a_t[:, seg_e]) @ dequant(b_t[:, seg_e]).T`` (E, N, K),
    zeros for an expert without rows; ``a_t`` (N, rows), ``b_t`` (K, rows) float8 with 128x1
    scales (rows/128, round4(N or K)): the columnwise buffers."""
    if _compiling():
        return torch.ops.fp8blk.grouped_mm_weights(a_t, a_t_scale, b_t, b_t_scale,
                                                   routing.table, out_dtype)
    return _weights_impl(a_t, a_t_scale, b_t, b_t_scale, out_dtype, routing.table, routing.host)


def grouped_mm_weights_tokens(a_t, a_t_scale, hidden, recipe, routing: Routing, out_dtype):
    """:func:`grouped_mm_weights` with ``b_t`` made from the tokens: ``hidden`` (T, K) permuted
    into the padded layout (``routing.permute``'s rows) and quantized columnwise with
    ``recipe`` (the bytes ``fb.quantize`` gives those rows), inside the call. (E, N, K)."""
    if _compiling():
        return torch.ops.fp8blk.grouped_mm_weights_tokens(a_t, a_t_scale, hidden,
                                                          routing.sources(),
                                                          recipe_key(recipe), routing.table,
                                                          out_dtype)
    return _weights_tokens_impl(a_t, a_t_scale, hidden, routing.sources(), recipe, out_dtype,
                                routing.table, routing.host)


def grouped_row_sums(dy, routing: Routing):
    """(E, N): each expert's routed rows of ``dy`` (rows, N) summed (a bias gradient, summed
    as the dense layer sums it)."""
    if _compiling():
        return torch.ops.fp8blk.grouped_row_sums(dy, routing.table)
    return _row_sums_impl(dy, routing.host())


__all__ = ["expert_weight_buffers", "expert_weight_both", "grouped_mm_rows", "grouped_mm_weights",
           "grouped_mm_weights_tokens", "grouped_row_sums", "packed_row_scales"]
