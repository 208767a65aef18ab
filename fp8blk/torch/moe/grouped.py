"""The experts' linear layer in block-scaled FP8: E weight matrices applied to the segments of
the padded token layout (``routing``), with the three GEMMs of a linear layer per expert
(docs/torch.md, "Experts").

    y[seg_e]  = x[seg_e] @ W_e.T      forward, m-grouped:   x 1x128,  W_e 128x128
    dx[seg_e] = dY[seg_e] @ W_e       input gradient:       dY 1x128, W_e.T 128x128
    dW_e      = dY[seg_e].T @ x[seg_e] weight gradient, k-grouped over the expert's rows:
                                                            dY, x 128x1 (columnwise)

Operands: the padded rows are quantized as one tensor (``fb.quantize``'s buffers; per expert
the bytes of its rows quantized alone, ``routing``); W (E, N, K) is quantized 128x128 per
expert (one quantize of the stacked (E*N, K) when N is a multiple of 128, whose tiles never
cross two experts), and W_e.T is its FP8 transpose (exact, as for a Block2D weight). The GEMMs
run per expert: on CUDA as cuBLASLt calls on addresses inside the grouped buffers (the direct
loops below), elsewhere and where cuBLASLt declines a signature through
:func:`~fp8blk.torch.blockwise_scaled_mm` (the emulation on the CPU); either way each expert's
output is the dense ``Float8BlockLinear``'s on its rows.
This path reads the segment table on the host once per routing (one device synchronization);
under torch.compile the per-expert loops are custom ops (``torch.ops.fp8blk.grouped_mm_rows``,
``grouped_mm_weights``, ``grouped_row_sums``) that read it themselves, so a compiled layer
has no graph break.

The experts' last projection and the combine run as one node (:func:`grouped_linear_combine`):
the router weights' gradient reads the projection's output, which a two-node graph keeps
((T*k, N), 2N bytes a routed pair in bf16); here the projection's rowwise FP8 input is kept
instead (K bytes a padded row, and its scales) and the same GEMM on the same bytes runs again
in the backward pass.

    import torch
    from fp8blk.torch import Float8BlockConfig
    from fp8blk.torch.moe.routing import route, permute
    from fp8blk.torch.moe.grouped import grouped_linear
    r = route(torch.randint(0, 4, (64, 2)), num_experts=4)
    x = permute(torch.randn(64, 256), r)
    w = torch.randn(4, 384, 256, requires_grad=True)
    grouped_linear(x, w, r, Float8BlockConfig()).sum().backward()    # y (r.rows, 384)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ... import _arrays
from .. import _cublaslt
from ..config import HIGH_DTYPES, Float8BlockConfig, config_or_default, fp8_dtype
from ..linear.functional import add_bias, quantize_buffers
from ..mlp import silu_gate_backward
from ..scaled_mm import blockwise_scaled_mm
from .routing import ALIGN, Routing, combine, host_table
from ...formats import recipe_kind
from ...layout import all_layouts, cdiv

_compiling = torch.compiler.is_compiling
_raw_stream = _arrays.torch_raw_stream


def check_experts_config(config: Float8BlockConfig, where: str):
    """Experts take Block1D activations and gradients with Block2D weights (the recipe whose
    tiles the padded layout keeps inside one expert); MXFP8 experts raise."""
    kinds = (recipe_kind(config.activation), recipe_kind(config.grad),
             recipe_kind(config.weight))
    if kinds != ("Block1D", "Block1D", "Block2D"):
        raise ValueError(f"{where}: experts run Block1D activations and gradients with Block2D "
                         f"weights (the default Float8BlockConfig), got {config!r}")


def _scale_transposed(scale, recipe, rows, cols):
    """Per-expert Block2D rowwise scales (E, rt, round4(ct)) of (rows, cols) weights as their
    columnwise scales (E, ct, round4(rt)): the transposed tiles' (``fp8blk.layout``'s shape
    and padding value)."""
    lay = all_layouts(recipe, rows, cols)[3]
    ct, rt = lay.shape[0], cdiv(rows, ALIGN)
    out = scale.new_full((scale.shape[0], *lay.shape), lay.fill)
    out[:, :, :rt] = scale[:, :rt, :ct].transpose(1, 2)
    return out


def expert_weight_buffers(weight: torch.Tensor, recipe, transposed: bool, rows_first: bool):
    """A 3-D expert weight's Block2D buffers, per expert: ``(data (E, R, C) float8, scale_inv
    (E, cdiv(R,128), round4(cdiv(C,128))) fp32)``, each expert's bytes equal to
    ``fb.quantize(W_e, recipe)``'s. ``weight`` is (E, N, K) (``transposed=False``) or
    (E, K, N) (``transposed=True``, as gpt-oss stores it); ``rows_first`` asks for W_e (N, K)
    (the forward operand), else W_e.T (K, N) (the input gradient's). The data's rows are
    contiguous (stride 1 along C); its experts and rows may be strided (the transpose of the
    stored orientation, when the stored rows are a multiple of 128 or E is 1, is a view of
    one columnwise quantize: row stride E*R)."""
    w = weight.detach()
    if w.dtype not in HIGH_DTYPES:
        raise TypeError(f"experts: weight dtype must be float32, bfloat16 or float16, got "
                        f"{w.dtype}")
    e, r, c = w.shape
    if rows_first == transposed and (r % ALIGN == 0 or e == 1):
        # the transpose asked for: one columnwise quantize of the stacked (E*R, C), read in
        # place -- expert e's W_e.T is columns [e*R, (e+1)*R) of its (C, E*R) data, a (C, R)
        # view with row stride E*R (cuBLASLt takes it as it is) -- instead of a rowwise
        # quantize and a byte transpose of all E*R*C bytes
        q = quantize_buffers(w.reshape(e * r, c).contiguous(), recipe, False, True)
        rt = cdiv(r, ALIGN)
        data = q[2].view(c, e, r).transpose(0, 1)
        lay = all_layouts(recipe, r, c)[3]              # one expert's (ct, round4(rt))
        scale = q[3].new_full((e, *lay.shape), lay.fill)
        scale[:, :, :rt] = q[3][:, :e * rt].view(lay.shape[0], e, rt).transpose(0, 1)
        return data.view(fp8_dtype(recipe.fmt)), scale
    if r % ALIGN == 0 or e == 1:
        q = quantize_buffers(w.reshape(e * r, c).contiguous(), recipe, True, False)
        data = q[0].view(e, r, c)
        scale = q[1].view(e, -1, q[1].shape[1])
    else:
        qs = [quantize_buffers(w[i].contiguous(), recipe, True, False) for i in range(e)]
        data = torch.stack([q[0] for q in qs])
        scale = torch.stack([q[1] for q in qs])
    if rows_first == (not transposed):          # the stored orientation is the one asked for
        return data.view(fp8_dtype(recipe.fmt)), scale
    data_t = data.transpose(1, 2).contiguous()
    return data_t.view(fp8_dtype(recipe.fmt)), _scale_transposed(scale, recipe, r, c)


def _rows_impl(a, a_scale, b, b_scale, host, out_dtype, bias, table=None):
    out = None if table is None else _direct_rows(a, a_scale, b, b_scale, host, table,
                                                  out_dtype)
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


def _weights_impl(a_t, a_t_scale, b_t, b_t_scale, host, out_dtype):
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
    return _rows_impl(a, a_scale, b, b_scale, host_table(table), out_dtype, bias, table)


@_rows_op.register_fake
def _rows_fake(a, a_scale, b, b_scale, table, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("fp8blk::grouped_mm_weights", mutates_args=())
def _weights_op(a_t: torch.Tensor, a_t_scale: torch.Tensor, b_t: torch.Tensor,
                b_t_scale: torch.Tensor, table: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    return _weights_impl(a_t, a_t_scale, b_t, b_t_scale, host_table(table), out_dtype)


@_weights_op.register_fake
def _weights_fake(a_t, a_t_scale, b_t, b_t_scale, table, out_dtype):
    return a_t.new_empty((table.shape[1], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)


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
    return _rows_impl(a, a_scale, b, b_scale, routing.host(), out_dtype, bias, routing.table)


def grouped_mm_weights(a_t, a_t_scale, b_t, b_t_scale, routing: Routing, out_dtype):
    """k-grouped: ``out[e] = dequant(a_t[:, seg_e]) @ dequant(b_t[:, seg_e]).T`` (E, N, K),
    zeros for an expert without rows; ``a_t`` (N, rows), ``b_t`` (K, rows) float8 with 128x1
    scales (rows/128, round4(N or K)): the columnwise buffers."""
    if _compiling():
        return torch.ops.fp8blk.grouped_mm_weights(a_t, a_t_scale, b_t, b_t_scale,
                                                   routing.table, out_dtype)
    return _weights_impl(a_t, a_t_scale, b_t, b_t_scale, routing.host(), out_dtype)


def grouped_row_sums(dy, routing: Routing):
    """(E, N): each expert's routed rows of ``dy`` (rows, N) summed (a bias gradient, summed
    as the dense layer sums it)."""
    if _compiling():
        return torch.ops.fp8blk.grouped_row_sums(dy, routing.table)
    return _row_sums_impl(dy, routing.host())


def _forward(x, weight, bias, routing, cfg, transposed, out_dtype, columns):
    """y = x @ W_e.T per segment, and x's quantized buffers (rowwise, and columnwise when
    ``columns``: the weight gradient's operand)."""
    qx = quantize_buffers(x.contiguous(), cfg.activation, True, columns)
    wd, ws = expert_weight_buffers(weight, cfg.weight, transposed, True)
    act = fp8_dtype(cfg.activation.fmt)
    return grouped_mm_rows(qx[0].view(act), qx[1], wd, ws, routing, out_dtype, bias), qx


def _backward(dy, xt_d, xt_s, weight, routing, cfg, transposed, x_dtype, needs, has_bias):
    """(dx, dW, dbias) of the experts' linear layer from dy (rows, N); ``needs``: whether x,
    W and the bias want their gradients; xt_d, xt_s: x's columnwise buffers (for dW)."""
    need_dgrad, need_wgrad, need_dbias = needs
    dx = dw = dbias = None
    dy = dy.contiguous()
    if has_bias and need_dbias:
        dbias = grouped_row_sums(dy, routing)
    if not (need_dgrad or need_wgrad):
        return dx, dw, dbias
    qdy = quantize_buffers(dy, cfg.grad, need_dgrad, need_wgrad)
    g = fp8_dtype(cfg.grad.fmt)
    if need_dgrad:
        wd, ws = expert_weight_buffers(weight, cfg.weight, transposed, False)
        dx = grouped_mm_rows(qdy[0].view(g), qdy[1], wd, ws, routing, x_dtype)
    if need_wgrad:
        dw = grouped_mm_weights(qdy[2].view(g), qdy[3], xt_d.view(fp8_dtype(cfg.activation.fmt)),
                                xt_s, routing, weight.dtype)
        if transposed:
            dw = dw.transpose(1, 2).contiguous()
    return dx, dw, dbias


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, routing, cfg, transposed, out_dtype, grad_enabled):
        need_wgrad = grad_enabled and weight.requires_grad
        y, qx = _forward(x, weight, bias, routing, cfg, transposed, out_dtype, need_wgrad)
        # saved: x's columnwise FP8 buffers and W (a parameter: held anyway)
        ctx.save_for_backward(qx[2] if need_wgrad else None,
                              qx[3] if need_wgrad else None, weight)
        ctx.routing, ctx.cfg, ctx.transposed, ctx.x_dtype = routing, cfg, transposed, x.dtype
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        xt_d, xt_s, weight = ctx.saved_tensors
        dx, dw, dbias = _backward(dy, xt_d, xt_s, weight, ctx.routing, ctx.cfg, ctx.transposed,
                                  ctx.x_dtype, ctx.needs_input_grad[:3], ctx.has_bias)
        return dx, dw, dbias, None, None, None, None, None


def _silu_gate(h):
    """transformers' default gating with SiLU, ``silu(g) * u`` of ``g, u = h.chunk(2, -1)``, as
    ``fp8blk.torch.mlp.silu_gate`` computes it."""
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


class _LinearCombineFn(torch.autograd.Function):
    """The down projection and the combine in one node: y is not kept for the backward pass
    (only the router weights' gradient reads it) but recomputed there by the same GEMM on the
    same FP8 bytes: byte for byte the y of the forward pass. Each gradient is autograd's
    arithmetic for ``combine(grouped_linear(x, ...), ...)`` (:func:`_combine_backward`), so
    every byte equals the two-node path's. The FP8 bytes are x's rowwise buffers, kept; with
    ``silu_gated`` the node takes h and computes x = silu(g) * u itself, keeping h alone (which
    the gating keeps anyway) and making x and its FP8 buffers again in the backward pass."""

    @staticmethod
    def forward(ctx, x, weight, bias, top_k_weights, routing, cfg, transposed, out_dtype, dtype,
                grad_enabled, silu_gated):
        need_wgrad = grad_enabled and weight.requires_grad
        need_y = grad_enabled and top_k_weights.requires_grad
        h = x
        if silu_gated:
            x = _silu_gate(h)
        y, qx = _forward(x, weight, bias, routing, cfg, transposed, out_dtype, need_wgrad)
        out = combine(y, routing, top_k_weights, dtype)
        # saved: h (silu_gated), or x's columnwise FP8 buffers (dW) and its rowwise ones (y
        # again, when the router weights want a gradient); W and the bias (parameters: held
        # anyway), the (T, k) weights
        if silu_gated:
            ctx.save_for_backward(h if grad_enabled else None, None, None, None, weight, bias,
                                  top_k_weights)
        else:
            ctx.save_for_backward(qx[2] if need_wgrad else None,
                                  qx[3] if need_wgrad else None, qx[0] if need_y else None,
                                  qx[1] if need_y else None, weight, bias, top_k_weights)
        ctx.routing, ctx.cfg, ctx.transposed, ctx.x_dtype = routing, cfg, transposed, x.dtype
        ctx.y_dtype, ctx.silu_gated = y.dtype, silu_gated
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        xt_d, xt_s, x_d, x_s, weight, bias, w = ctx.saved_tensors
        cfg, routing = ctx.cfg, ctx.routing
        need_h, need_wgrad, need_dbias, need_router = ctx.needs_input_grad[:4]
        h = None
        if ctx.silu_gated:        # x and its FP8 buffers again, from h: the forward's bytes
            h, xt_d = xt_d, None
            if need_router or need_wgrad:
                x_d, x_s, xt_d, xt_s = quantize_buffers(_silu_gate(h).contiguous(),
                                                        cfg.activation, need_router, need_wgrad)
        y = None
        if need_router:
            wd, ws = expert_weight_buffers(weight, cfg.weight, ctx.transposed, True)
            y = grouped_mm_rows(x_d.view(fp8_dtype(cfg.activation.fmt)), x_s, wd, ws, routing,
                                ctx.y_dtype, bias)
        needs = (need_h, need_wgrad, need_dbias)
        dy, dw_router = _combine_backward(dout, y, w, routing, ctx.y_dtype, any(needs))
        y = x_d = x_s = None
        dx, dw, dbias = (None, None, None) if dy is None else _backward(
            dy, xt_d, xt_s, weight, routing, cfg, ctx.transposed, ctx.x_dtype, needs,
            bias is not None)
        if h is not None and dx is not None:
            # the gating's backward as autograd runs it: silu_gate's, then the chunk's (a cat)
            dg, du = silu_gate_backward(*h.chunk(2, dim=-1), dx)
            dx = torch.cat([dg, du], dim=-1)
        return dx, dw, dbias, dw_router, None, None, None, None, None, None, None


def _combine_backward(dout, y, w, routing, y_dtype, need_rows):
    """The gradients of ``routing.combine(y, routing, w, dtype)`` as autograd computes them
    node by node (ToCopy, Sum, View, Mul with its broadcast reduction and dtype casts, Index):
    (d y (rows, N) in y's dtype or None, d w (T, k) in w's dtype or None; y None: no d w)."""
    tokens, top_k = routing.tokens, routing.top_k
    width = dout.shape[-1]
    g = dout.to(torch.promote_types(y_dtype, w.dtype))
    g = g.unsqueeze(1).expand(tokens, top_k, width).reshape(tokens * top_k, width)
    dy = dw = None
    if need_rows:
        d_picked = (g * w.reshape(-1).unsqueeze(-1)).to(y_dtype)
        # the index's backward as autograd runs it: an accumulating put into zeros
        dy = d_picked.new_zeros((routing.rows, width))
        dy.index_put_((routing.dest,), d_picked, accumulate=True)
    if y is not None:
        dw = (g * y[routing.dest]).sum(1, keepdim=True).to(w.dtype).view(tokens, top_k)
    return dy, dw


def _checked(x, weight, routing, config, bias, transposed, where):
    """The config (default filled in) and the output dtype of the experts' linear layer, after
    checking the arguments' shapes and dtypes (:func:`grouped_linear`)."""
    config = config_or_default(config, where)
    check_experts_config(config, where)
    if weight.dim() != 3 or weight.shape[0] != routing.num_experts:
        raise ValueError(f"{where}: weight must be ({routing.num_experts}, out, in), got "
                         f"shape {tuple(weight.shape)}")
    k = weight.shape[1] if transposed else weight.shape[2]
    if x.dim() != 2 or x.shape != (routing.rows, k):
        raise ValueError(f"{where}: x must be ({routing.rows}, {k}) (the padded layout "
                         f"of the routing), got shape {tuple(x.shape)}")
    if x.dtype not in HIGH_DTYPES:
        raise TypeError(f"{where}: x dtype must be float32, bfloat16 or float16, got "
                        f"{x.dtype}")
    n = weight.shape[2] if transposed else weight.shape[1]
    if bias is not None and tuple(bias.shape) != (routing.num_experts, n):
        raise ValueError(f"{where}: bias must be ({routing.num_experts}, {n}), got "
                         f"shape {tuple(bias.shape)}")
    device = x.device.type
    out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x.dtype)
    return config, out_dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, routing: Routing,
                   config: Float8BlockConfig = None, *, bias: torch.Tensor = None,
                   transposed: bool = False):
    """The experts' linear layer: ``y[seg_e] = x[seg_e] @ W_e.T`` in block-scaled FP8 (module
    docstring), differentiable in x and W.

    x (routing.rows, K) float32/bfloat16/float16 in the padded layout (``routing.permute``:
    padding rows zero); weight (E, N, K), or (E, K, N) with ``transposed=True``; bias (E, N)
    or None, added to each expert's routed rows. Returns (routing.rows, N) in x's dtype (the
    autocast dtype under ``torch.autocast``), padding rows zero; dW in the weight's dtype,
    zero for an expert without rows."""
    config, out_dtype = _checked(x, weight, routing, config, bias, transposed,
                                 "grouped_linear")
    return _GroupedLinearFn.apply(x, weight, bias, routing, config, bool(transposed), out_dtype,
                                  torch.is_grad_enabled())


def grouped_linear_combine(x: torch.Tensor, weight: torch.Tensor, routing: Routing,
                           top_k_weights: torch.Tensor, dtype, config: Float8BlockConfig = None,
                           *, bias: torch.Tensor = None, transposed: bool = False,
                           silu_gated: bool = False):
    """``routing.combine(grouped_linear(x, weight, routing, config, bias=bias,
    transposed=transposed), routing, top_k_weights, dtype)``: the experts' last projection
    and the weighted sum over each token's k rows, (T, N) in ``dtype``, with the same bytes
    forward and backward (d x, d W, d bias, d top_k_weights), but without keeping the
    projection's (T*k, N) output for the router weights' gradient: x's rowwise FP8 buffers
    (one byte per element and the 1x128 scales) are kept instead and the GEMM runs again in
    the backward pass (:class:`_LinearCombineFn`). Arguments as :func:`grouped_linear` and
    ``routing.combine``. ``silu_gated``: ``x`` is h (rows, 2K) and the projection's input is
    transformers' default SiLU gating of it, ``silu(g) * u`` with ``g, u = h.chunk(2, -1)``
    (``fp8blk.torch.mlp.silu_gate``'s bytes); then h alone is kept, the gated rows and their
    FP8 buffers are made again in the backward pass."""
    if silu_gated and (x.dim() != 2 or x.shape[-1] % 2):
        raise ValueError(f"grouped_linear_combine: a SiLU-gated input is (rows, 2K), got "
                         f"shape {tuple(x.shape)}")
    gated = x[:, :x.shape[1] // 2] if silu_gated else x    # the shape the projection takes
    config, out_dtype = _checked(gated, weight, routing, config, bias, transposed,
                                 "grouped_linear_combine")
    return _LinearCombineFn.apply(x, weight, bias, top_k_weights, routing, config,
                                  bool(transposed), out_dtype, dtype, torch.is_grad_enabled(),
                                  bool(silu_gated))


__all__ = ["grouped_linear", "grouped_linear_combine", "expert_weight_buffers",
           "grouped_mm_rows", "grouped_mm_weights", "grouped_row_sums", "check_experts_config"]
