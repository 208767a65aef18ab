"""The experts' linear layer in block-scaled FP8: E weight matrices applied to the segments of
the padded token layout (``routing``), with the three GEMMs of a linear layer per expert
(docs/torch.md, "Experts").

    y[seg_e]  = x[seg_e] @ W_e.T      forward, m-grouped:   x 1x128,  W_e 128x128
    dx[seg_e] = dY[seg_e] @ W_e       input gradient:       dY 1x128, W_e.T 128x128
    dW_e      = dY[seg_e].T @ x[seg_e] weight gradient, k-grouped over the expert's rows:
                                                            dY, x 128x1 (columnwise)

Operands: the padded rows are quantized as one tensor (``fb.quantize``'s buffers; per expert
the bytes of its rows quantized alone, ``routing``); W's per-expert 128x128 operands and the
per-expert GEMMs are ``gemms``'s, each expert's output the dense ``Float8BlockLinear``'s on
its rows.

The experts' last projection and the combine run as one node (:func:`grouped_linear_combine`):
the router weights' gradient reads the projection's output, which a two-node graph keeps
((T*k, N), 2N bytes a routed pair in bf16); here the projection's rowwise FP8 input is kept
instead (K bytes a padded row, and its scales) and the same GEMM on the same bytes runs again
in the backward pass. Compiled, the experts run separate nodes instead
(``fp8blk.torch.moe.experts``; with ``COMPILED_RECOMPUTE`` in a checkpointed region), as the
node traced through would keep no less.

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

import os

import torch

from ..config import HIGH_DTYPES, Float8BlockConfig, config_or_default, fp8_dtype
from ..linear.functional import quantize_buffers
from ..mlp import silu_gate_backward_cat, silu_gate_forward
from .gemms import (expert_weight_both, expert_weight_buffers, grouped_mm_rows, grouped_mm_weights,
                    grouped_mm_weights_tokens, grouped_row_sums)
from .routing import Routing, combine, permute_backward, permute_forward
from ...formats import recipe_kind
from ...kernels.weighted_rows import serves as weighted_rows_serves, weighted_rows

# eager on CUDA the combine's row gradients come from one kernel (fp8blk.kernels.weighted_rows,
# the same bytes); FP8BLK_MOE_KERNELS=0, or this set False, keeps torch's ops
KERNELS = os.environ.get("FP8BLK_MOE_KERNELS", "1") != "0"
# compiled, the experts after their first projection (the gating, the down projection, the
# combine) run in a checkpointed region when this is True (FP8BLK_MOE_COMPILED_RECOMPUTE=1):
# the partitioner makes them again in the backward pass, so the compiled block keeps what the
# eager one keeps, at the cost of the recomputation (the down projection's GEMM among it;
# docs/torch.md, "Experts"); by default they run as separate nodes, which keep their outputs
COMPILED_RECOMPUTE = os.environ.get("FP8BLK_MOE_COMPILED_RECOMPUTE", "0") == "1"


def check_experts_config(config: Float8BlockConfig, where: str):
    """Experts take Block1D activations and gradients with Block2D weights (the recipe whose
    tiles the padded layout keeps inside one expert); MXFP8 experts raise."""
    kinds = (recipe_kind(config.activation), recipe_kind(config.grad),
             recipe_kind(config.weight))
    if kinds != ("Block1D", "Block1D", "Block2D"):
        raise ValueError(f"{where}: experts run Block1D activations and gradients with Block2D "
                         f"weights (the default Float8BlockConfig), got {config!r}")


def _forward(x, weight, bias, routing, cfg, transposed, out_dtype, columns):
    """y = x @ W_e.T per segment, and x's quantized buffers (rowwise, and columnwise when
    ``columns``: the weight gradient's operand)."""
    qx = quantize_buffers(x.contiguous(), cfg.activation, True, columns)
    wd, ws = expert_weight_buffers(weight, cfg.weight, transposed, True)
    act = fp8_dtype(cfg.activation.fmt)
    return grouped_mm_rows(qx[0].view(act), qx[1], wd, ws, routing, out_dtype, bias), qx


def _backward(operands, xt_d, xt_s, weight, routing, cfg, transposed, x_dtype, needs,
              has_bias, tokens=None):
    """(dx, dW, dbias) of the experts' linear layer. ``operands``: a list [dy (rows, N), W's
    transposed operand or None] that this function empties, so that where the caller keeps no
    other reference each is freed once dead (dy after its quantization; W.T, with dy's
    rowwise copy, after the input gradient, before dW, a parameter's size, is allocated);
    ``needs``: whether x, W and the bias want their gradients; xt_d, xt_s: x's columnwise
    buffers (for dW), or ``tokens`` (T, K): x is their permuted rows, quantized inside dW's
    call (``gemms.grouped_mm_weights_tokens``)."""
    dy, w_t = operands
    operands.clear()
    need_dgrad, need_wgrad, need_dbias = needs
    dx = dw = dbias = None
    dy = dy.contiguous()
    if has_bias and need_dbias:
        dbias = grouped_row_sums(dy, routing)
    if not (need_dgrad or need_wgrad):
        return dx, dw, dbias
    qdy = list(quantize_buffers(dy, cfg.grad, need_dgrad, need_wgrad))
    dy = None
    g = fp8_dtype(cfg.grad.fmt)
    if need_dgrad:
        wd, ws = w_t or expert_weight_buffers(weight, cfg.weight, transposed, False)
        w_t = None
        dx = grouped_mm_rows(qdy[0].view(g), qdy[1], wd, ws, routing, x_dtype)
        wd = ws = qdy[0] = qdy[1] = None
    if need_wgrad:
        if tokens is not None:
            dw = grouped_mm_weights_tokens(qdy[2].view(g), qdy[3], tokens, cfg.activation,
                                           routing, weight.dtype)
        else:
            dw = grouped_mm_weights(qdy[2].view(g), qdy[3],
                                    xt_d.view(fp8_dtype(cfg.activation.fmt)), xt_s, routing,
                                    weight.dtype)
        if transposed:
            dw = dw.transpose(1, 2).contiguous()
    return dx, dw, dbias


class _GroupedLinearFn(torch.autograd.Function):
    """The experts' linear layer on the padded rows x; with ``permuted``, x is the tokens
    (T, K) and ``permute`` runs in the node too, which keeps the tokens instead of the
    permuted rows' columnwise FP8 copy (routing.rows, K): the forward pass quantizes the
    permuted rows rowwise only, the backward pass permutes the tokens again and quantizes
    them columnwise (the forward's bytes: the same rows, the same recipe) inside dW's call,
    and returns the tokens' gradient as ``permute``'s backward sums it."""

    @staticmethod
    def forward(ctx, x, weight, bias, routing, cfg, transposed, out_dtype, grad_enabled,
                permuted):
        need_wgrad = grad_enabled and weight.requires_grad
        rows = permute_forward(x, routing) if permuted else x
        y, qx = _forward(rows, weight, bias, routing, cfg, transposed, out_dtype,
                         need_wgrad and not permuted)
        # saved: x's columnwise FP8 buffers, or the tokens (what the router keeps for its own
        # gradient); W (a parameter: held anyway)
        if permuted:
            ctx.save_for_backward(x if need_wgrad else None, None, weight)
        else:
            ctx.save_for_backward(qx[2] if need_wgrad else None,
                                  qx[3] if need_wgrad else None, weight)
        ctx.routing, ctx.cfg, ctx.transposed, ctx.x_dtype = routing, cfg, transposed, x.dtype
        ctx.has_bias, ctx.permuted = bias is not None, permuted
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        xt_d, xt_s, weight = ctx.saved_tensors
        tokens = None
        if ctx.permuted:
            tokens, xt_d = xt_d, None
        dx, dw, dbias = _backward([dy, None], xt_d, xt_s, weight, ctx.routing, ctx.cfg,
                                  ctx.transposed, ctx.x_dtype, ctx.needs_input_grad[:3],
                                  ctx.has_bias, tokens=tokens)
        if ctx.permuted and dx is not None:
            dx = permute_backward(dx, ctx.routing)
        return dx, dw, dbias, None, None, None, None, None, None


def _silu_gate(h):
    """transformers' default gating with SiLU, ``silu(g) * u`` of ``g, u = h.chunk(2, -1)``, as
    ``fp8blk.torch.mlp.silu_gate`` computes it."""
    return silu_gate_forward(*h.chunk(2, dim=-1))


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
        grads = _linear_combine_backward(dout, (xt_d, xt_s, x_d, x_s), weight, bias, w,
                                         routing, cfg, ctx.transposed, ctx.x_dtype,
                                         ctx.y_dtype, ctx.silu_gated,
                                         tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None, None, None, None, None, None)


def _linear_combine_backward(dout, saved, weight, bias, w, routing, cfg, transposed, x_dtype,
                             y_dtype, silu_gated, needs):
    """:class:`_LinearCombineFn`'s gradients (d x or d h, d W, d bias, d top_k_weights; None
    where ``needs`` says no) from dout and what its forward pass saved."""
    xt_d, xt_s, x_d, x_s = saved
    need_h, need_wgrad, need_dbias, need_router = needs
    h = None
    if silu_gated:        # x and its FP8 buffers again, from h: the forward's bytes
        h, xt_d = xt_d, None
        if need_router or need_wgrad:
            x_d, x_s, xt_d, xt_s = quantize_buffers(_silu_gate(h).contiguous(),
                                                    cfg.activation, need_router, need_wgrad)
    y = w_t = None
    if need_router:
        # W_e for y again and, when the input gradient follows, W_e.T from the same pass
        if need_h:
            (wd, ws), w_t = expert_weight_both(weight, cfg.weight, transposed)
        else:
            wd, ws = expert_weight_buffers(weight, cfg.weight, transposed, True)
        y = grouped_mm_rows(x_d.view(fp8_dtype(cfg.activation.fmt)), x_s, wd, ws, routing,
                            y_dtype, bias)
    grads = (need_h, need_wgrad, need_dbias)
    dy, dw_router = _combine_backward(dout, y, w, routing, y_dtype, any(grads))
    y = x_d = x_s = wd = ws = None
    dx = dw = dbias = None
    if dy is not None:
        # handed over, not kept here: _backward frees dy and W.T once they are dead
        operands, dy, w_t = [dy, w_t], None, None
        dx, dw, dbias = _backward(operands, xt_d, xt_s, weight, routing, cfg, transposed,
                                  x_dtype, grads, bias is not None)
    if h is not None and dx is not None:
        # the gating's backward as autograd runs it: silu_gate's, then the chunk's (a cat)
        dx = silu_gate_backward_cat(h, dx)
    return dx, dw, dbias, dw_router


def _kernel_rows(dout, w, routing, y_dtype):
    """The combine's row gradients from one kernel (``fp8blk.kernels.weighted_rows``: the
    bytes of the torch ops below), or None where it does not serve: eager on CUDA, dout in
    y's dtype and bf16 (the product is then rounded once from fp32 whichever dtype the
    weights' promotion gives)."""
    if not (KERNELS and dout.is_cuda and dout.dtype == y_dtype and type(dout) is torch.Tensor
            and w.dtype in (torch.float32, y_dtype) and not torch.compiler.is_compiling()):
        return None
    wf, pairs = w.reshape(-1).float(), routing.pairs()
    if not weighted_rows_serves(dout, wf, pairs):
        return None
    return weighted_rows(dout, wf, pairs, routing.top_k)


def _combine_backward(dout, y, w, routing, y_dtype, need_rows):
    """The gradients of ``routing.combine(y, routing, w, dtype)`` as autograd computes them
    node by node (ToCopy, Sum, View, Mul with its broadcast reduction and dtype casts, Index):
    (d y (rows, N) in y's dtype or None, d w (T, k) in w's dtype or None; y None: no d w)."""
    tokens, top_k = routing.tokens, routing.top_k
    width = dout.shape[-1]
    # (T, 1, H) against (T, k, 1) / (T, k, H): the broadcast products autograd computes on the
    # expanded (T*k, H) gradient, without materializing it
    g = dout.to(torch.promote_types(y_dtype, w.dtype)).unsqueeze(1)
    dy = dw = None
    if need_rows:
        # one pass where it serves: each padded row its token's gradient times its weight
        dy = _kernel_rows(dout, w, routing, y_dtype)
    if need_rows and dy is None:
        # the product rounded once to y's dtype on store (the fp32 product, then the cast),
        # plus +0: the index's backward as autograd runs it is an accumulating put into zeros,
        # which turns a -0 into +0; the rows are distinct, so a plain copy does the rest
        d_picked = torch.empty((tokens, top_k, width), dtype=y_dtype, device=dout.device)
        torch.addcmul(g.new_zeros(()), g, w.unsqueeze(-1), out=d_picked)
        dy = d_picked.new_zeros((routing.rows, width))
        dy.index_copy_(0, routing.dest, d_picked.view(tokens * top_k, width))
    if y is not None:
        dw = (g * y[routing.dest].view(tokens, top_k, width)).sum(-1).to(w.dtype)
    return dy, dw


def _checked(x_shape, x_dtype, device, weight, routing, config, bias, transposed, where):
    """The config (default filled in) and the output dtype of the experts' linear layer, after
    checking the arguments' shapes and dtypes (:func:`grouped_linear`; x's shape, dtype and
    device type given)."""
    config = config_or_default(config, where)
    check_experts_config(config, where)
    if weight.dim() != 3 or weight.shape[0] != routing.num_experts:
        raise ValueError(f"{where}: weight must be ({routing.num_experts}, out, in), got "
                         f"shape {tuple(weight.shape)}")
    k = weight.shape[1] if transposed else weight.shape[2]
    if tuple(x_shape) != (routing.rows, k):
        raise ValueError(f"{where}: x must be ({routing.rows}, {k}) (the padded layout "
                         f"of the routing), got shape {tuple(x_shape)}")
    if x_dtype not in HIGH_DTYPES:
        raise TypeError(f"{where}: x dtype must be float32, bfloat16 or float16, got "
                        f"{x_dtype}")
    n = weight.shape[2] if transposed else weight.shape[1]
    if bias is not None and tuple(bias.shape) != (routing.num_experts, n):
        raise ValueError(f"{where}: bias must be ({routing.num_experts}, {n}), got "
                         f"shape {tuple(bias.shape)}")
    out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x_dtype)
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
    config, out_dtype = _checked(x.shape, x.dtype, x.device.type, weight, routing, config,
                                 bias, transposed, "grouped_linear")
    return _GroupedLinearFn.apply(x, weight, bias, routing, config, bool(transposed), out_dtype,
                                  torch.is_grad_enabled(), False)


def permute_grouped_linear(hidden: torch.Tensor, weight: torch.Tensor, routing: Routing,
                           config: Float8BlockConfig = None, *, bias: torch.Tensor = None,
                           transposed: bool = False):
    """``grouped_linear(permute(hidden, routing), weight, routing, config, bias=bias,
    transposed=transposed)`` with the same bytes forward and backward (y, d hidden, d W,
    d bias), keeping ``hidden`` (T, K) for the weight gradient instead of the permuted rows'
    columnwise FP8 copy (routing.rows x K bytes and its scales): the rows are permuted and
    quantized again in the backward pass (:class:`_GroupedLinearFn`). Fewer bytes wherever
    hidden is kept anyway (a router reading the same tokens keeps them for its own gradient)
    or ``hidden.element_size() * T <= routing.rows`` (top-k >= 2 in bf16). ``hidden`` (T, K)
    float32/bfloat16/float16; the rest as :func:`grouped_linear`; returns (routing.rows, N).

        import torch
        from fp8blk.torch.moe.routing import route
        from fp8blk.torch.moe.grouped import permute_grouped_linear
        r = route(torch.randint(0, 4, (64, 2)), num_experts=4)
        hidden = torch.randn(64, 256, requires_grad=True)
        w = torch.randn(4, 384, 256, requires_grad=True)
        permute_grouped_linear(hidden, w, r).sum().backward()      # y (r.rows, 384)
    """
    if hidden.dim() != 2 or hidden.shape[0] != routing.tokens:
        raise ValueError(f"permute_grouped_linear: hidden must be ({routing.tokens}, K), got "
                         f"shape {tuple(hidden.shape)}")
    k = weight.shape[1 if transposed else 2] if weight.dim() == 3 else None
    if k is not None and hidden.shape[1] != k:
        raise ValueError(f"permute_grouped_linear: hidden has {hidden.shape[1]} features, the "
                         f"weight {tuple(weight.shape)} takes {k}")
    config, out_dtype = _checked((routing.rows, hidden.shape[1]), hidden.dtype,
                                 hidden.device.type, weight, routing, config, bias, transposed,
                                 "permute_grouped_linear")
    routing.sources()       # the gather's rows, made (once per routing) outside the node
    return _GroupedLinearFn.apply(hidden, weight, bias, routing, config, bool(transposed),
                                  out_dtype, torch.is_grad_enabled(), True)


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
    config, out_dtype = _checked(gated.shape, gated.dtype, gated.device.type, weight, routing,
                                 config, bias, transposed, "grouped_linear_combine")
    return _LinearCombineFn.apply(x, weight, bias, top_k_weights, routing, config,
                                  bool(transposed), out_dtype, dtype, torch.is_grad_enabled(),
                                  bool(silu_gated))


__all__ = ["grouped_linear", "grouped_linear_combine", "permute_grouped_linear",
           "check_experts_config"]
