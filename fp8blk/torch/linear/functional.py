"""The functional form of Float8BlockLinear: fp8blk's quantize and Block2D transpose as torch
custom ops (``torch.ops.fp8blk.*``, so ``torch.compile(fullgraph=True)`` traces a layer without
graph breaks; quantized tensors travel as 4 plain buffers), the autograd function running a
linear layer's three GEMMs in block-scaled FP8, each GEMM's operand choice, and
:func:`weight_block_tensor`, the door through which a layer gets its quantized weight.
docs/torch.md describes the math, memory and interface.

    y = float8_block_linear(x, weight, bias, Float8BlockConfig())
"""
from __future__ import annotations

import torch

from ... import _arrays
from ...formats import MXFP8, recipe_from_key, recipe_key
from ...layout import all_layouts
from ...ops import quantize_buffers as _ops_quantize_buffers
from ...tensor import BlockTensor
from ..config import HIGH_DTYPES, Float8BlockConfig, config_or_default, fp8_dtype
from ..scaled_mm import blocks_of, blockwise_scaled_mm
from . import compiled, plans, sharing

_compiling = torch.compiler.is_compiling

_EMPTIES = {}


def _empty(device, fresh=True):
    if fresh:
        return torch.empty((0,), dtype=torch.uint8, device=device)
    hit = _EMPTIES.get(device)     # one shared placeholder per device: host time on CUDA
    if hit is None:
        hit = _EMPTIES[device] = torch.empty((0,), dtype=torch.uint8, device=device)
    return hit


def block_tensor_buffers(q: BlockTensor, fresh: bool = False):
    """The 4 buffers of a BlockTensor as torch tensors (empty (0,) tensors where absent;
    ``fresh``: new ones, as a custom op's outputs must not alias each other)."""
    return _four((q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data,
                  q.columnwise_scale_inv), fresh)


def _four(bufs, fresh=False):
    """4 torch buffers, None (a direction not held) as an empty (0,) tensor."""
    if bufs[0] is not None and bufs[2] is not None:
        return tuple(bufs)
    device = (bufs[0] if bufs[0] is not None else bufs[2]).device
    return tuple(_empty(device, fresh) if b is None else b for b in bufs)


def block_tensor_from_buffers(shape, recipe, buffers, dtype) -> BlockTensor:
    """A BlockTensor (torch family) over the given torch buffers, without copies; empty
    buffers mean "direction not held". ``dtype`` is the torch dtype that was quantized."""
    internal = [None if b.dim() == 1 and b.numel() == 0 else _arrays.to_internal(b)[0]
                for b in buffers]
    return BlockTensor(shape, recipe, *internal, dtype=_arrays.numpy_dtype(dtype),
                       family=_arrays.TORCH)


@torch.library.custom_op("fp8blk::quantize", mutates_args=())
def _quantize(x: torch.Tensor, recipe: str, rowwise: bool, columnwise: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # outputs must not alias each other or the input; fp8blk allocates fresh buffers
    return _four(_ops_quantize_buffers(x, recipe_from_key(recipe), rowwise, columnwise),
                 fresh=True)


@_quantize.register_fake
def _quantize_fake(x, recipe, rowwise, columnwise):
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    layouts = all_layouts(recipe_from_key(recipe), rows, x.shape[-1])
    out = []
    for i, lay in enumerate(layouts):
        held = rowwise if i < 2 else columnwise
        out.append(x.new_empty(lay.shape if held else (0,),
                               dtype=_arrays.numpy_to_torch_dtype(lay.dtype) if held
                               else torch.uint8))
    return tuple(out)


def _block2d_transpose_impl(data, scale_inv, recipe):
    rows, cols = data.shape
    q = block_tensor_from_buffers((rows, cols), recipe,
                                  (data, scale_inv, _empty(data.device), _empty(data.device)),
                                  torch.float32)
    q.create_columnwise()
    return q.columnwise_data, q.columnwise_scale_inv


@torch.library.custom_op("fp8blk::block2d_transpose", mutates_args=())
def _block2d_transpose(data: torch.Tensor, scale_inv: torch.Tensor, recipe: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return _block2d_transpose_impl(data, scale_inv, recipe_from_key(recipe))


@_block2d_transpose.register_fake
def _block2d_transpose_fake(data, scale_inv, recipe):
    rows, cols = data.shape
    lay = all_layouts(recipe_from_key(recipe), rows, cols)
    return (data.new_empty(lay[2].shape, dtype=torch.uint8),
            data.new_empty(lay[3].shape, dtype=torch.float32))


# In eager mode the functions below call the implementations directly: a Python custom op's
# dispatch costs tens of microseconds of host time per call, which the hot path does not need.
# Under torch.compile they go through the ops, which dynamo and the fake implementations trace.


def quantize_buffers(x2d: torch.Tensor, recipe, rowwise: bool, columnwise: bool):
    """``fb.quantize(x2d, recipe, rowwise, columnwise)``: 4 tensors (see module docstring)."""
    if _compiling():
        return torch.ops.fp8blk.quantize(x2d, recipe_key(recipe), rowwise, columnwise)
    return _four(_ops_quantize_buffers(x2d, recipe, rowwise, columnwise))


def block2d_columnwise(data: torch.Tensor, scale_inv: torch.Tensor, recipe):
    """Block2D columnwise buffers (K, M) data and scale_inv from the rowwise (M, K) ones, by
    FP8 transpose (``BlockTensor.create_columnwise``, no requantization)."""
    if _compiling():
        return torch.ops.fp8blk.block2d_transpose(data, scale_inv, recipe_key(recipe))
    return _block2d_transpose_impl(data, scale_inv, recipe)


def mxfp8_columnwise_as_rows(data: torch.Tensor, scale_inv: torch.Tensor):
    """MXFP8 columnwise (M, K) data with 32x1 blocks and scales (round4(M/32), round128(K))
    re-laid as the rowwise buffers of the transpose: (K, M) data with 1x32 blocks and scales
    (round128(K), round4(M/32)). Copies both (MXFP8's columnwise layout is not transposed,
    docs/layouts.md): a documented cost of the MXFP8 option."""
    return data.t().contiguous(), scale_inv.t().contiguous()




def _f8(data, recipe):
    return data.view(fp8_dtype(recipe.fmt))


def weight_block_tensor(weight, config: Float8BlockConfig, rowwise: bool, columnwise: bool):
    """The weight's FP8 buffers ``(rowwise_data, rowwise_scale_inv, columnwise_data,
    columnwise_scale_inv)`` (empty (0,) tensors for a direction not asked for).

    If ``weight`` has ``fp8blk_block_tensor(rowwise, columnwise)`` (the FSDP2 FP8 weight), its
    BlockTensor is used as it is; else the high-precision weight is quantized with
    ``config.weight``."""
    hook = getattr(weight, "fp8blk_block_tensor", None)
    if hook is not None:
        q = hook(rowwise, columnwise)
        if q.recipe != config.weight:
            raise ValueError(f"the weight's fp8blk_block_tensor() returned {q.recipe!r} data "
                             f"but the layer's config.weight is {config.weight!r}")
        if tuple(q.shape) != tuple(weight.shape):
            raise ValueError(f"the weight's fp8blk_block_tensor() returned shape {q.shape}, "
                             f"expected {tuple(weight.shape)}")
        return block_tensor_buffers(q)
    w = weight.detach()
    if w.dtype not in HIGH_DTYPES:
        raise TypeError(f"Float8BlockLinear: weight dtype must be float32, bfloat16 or float16, "
                        f"got {w.dtype}")
    return quantize_buffers(w.contiguous(), config.weight, rowwise, columnwise)


@torch.library.custom_op("fp8blk::cast_to", mutates_args=())
def _cast_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


@_cast_to.register_fake
def _cast_to_fake(t, dtype):
    return torch.empty_like(t, dtype=dtype)


def add_bias(y, bias):
    """``y + bias.to(y.dtype)``: the bias rounded to y's dtype (the autocast dtype under
    autocast), then added. Compiled, the rounding is an op of its own (``fp8blk::cast_to``):
    inductor fuses a ``.to`` into the add that follows and skips the rounding (its
    ``emulate_precision_casts`` is off by default), which would give other bytes than eager."""
    if bias.dtype != y.dtype:
        bias = (torch.ops.fp8blk.cast_to(bias, y.dtype) if _compiling()
                else bias.to(y.dtype))
    return y + bias


# operand selection of each GEMM: one function each, so tests can check (and plant bugs in)
# exactly one choice at a time
def forward_operands(qx, qw, cfg):
    """(a, a_sinv, b, b_sinv, a_blocks, b_blocks) of y = x @ W.T."""
    return (_f8(qx[0], cfg.activation), qx[1], _f8(qw[0], cfg.weight), qw[1],
            blocks_of(cfg.activation), blocks_of(cfg.weight))


def dgrad_operands(qdy, qw_t, cfg):
    """dx = dY @ W: b is W's columnwise buffer (K, N), the FP8 transpose."""
    return (_f8(qdy[0], cfg.grad), qdy[1], _f8(qw_t[0], cfg.weight), qw_t[1],
            blocks_of(cfg.grad), blocks_of(cfg.weight))


def wgrad_operands(qdy_t, qx_t, cfg):
    """dW = dY.T @ x over tokens: both operands are the columnwise (transposed, 128x1)
    buffers, dY.T (N, M) and x.T (K, M)."""
    return (_f8(qdy_t[0], cfg.grad), qdy_t[1], _f8(qx_t[0], cfg.activation), qx_t[1],
            blocks_of(cfg.grad), blocks_of(cfg.activation))


def transposed(buffers, recipe):
    """Columnwise buffers of a quantized tensor as the rowwise buffers of its transpose."""
    if isinstance(recipe, MXFP8):
        return mxfp8_columnwise_as_rows(buffers[2], buffers[3])
    return buffers[2], buffers[3]


def weight_transposed(qw, recipe):
    if isinstance(recipe, MXFP8):
        return mxfp8_columnwise_as_rows(qw[2], qw[3])
    if qw[2].numel():                       # the backward pass asks for columnwise buffers
        return qw[2], qw[3]
    return block2d_columnwise(qw[0], qw[1], recipe)


def quantize_input(x2d, recipe, need_columnwise):
    return quantize_buffers(x2d, recipe, True, need_columnwise)


def fp8_gemms_backward(dy2d, qx_t, qw, cfg, need_dgrad, need_wgrad, dx_dtype, dw_dtype,
                       qdy=None):
    """(dx (M, K) or None, dW (N, K) or None) from dY (M, N). ``qdy``: dY's buffers when the
    caller already has them (the sequence-parallel FP8 gather)."""
    dx = dw = None
    if not (need_dgrad or need_wgrad):     # only the bias needs a gradient
        return dx, dw
    if qdy is None:
        qdy = quantize_buffers(dy2d, cfg.grad, need_dgrad, need_wgrad)
    if need_dgrad:
        dx = blockwise_scaled_mm(*dgrad_operands(qdy, weight_transposed(qw, cfg.weight), cfg),
                                 out_dtype=dx_dtype)
    if need_wgrad:
        dw = blockwise_scaled_mm(*wgrad_operands(transposed(qdy, cfg.grad), qx_t, cfg),
                                 out_dtype=dw_dtype)
    return dx, dw


class _Float8BlockLinearFn(torch.autograd.Function):
    # the call's settings travel as one argument, (cfg, out_dtype, grad_enabled, keep_input):
    # Function.apply's host time grows with the argument count
    @staticmethod
    def forward(ctx, x, weight, bias, settings):
        cfg, out_dtype, grad_enabled, keep_input = settings
        # a 2-D x is used as it is: a reshape view costs host time on every call
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        # grad_enabled: the caller's grad mode (forward itself always runs without grad, and
        # needs_input_grad says True under torch.no_grad too): without it no backward follows,
        # so x's columnwise copy is neither made nor kept
        need_wgrad = grad_enabled and weight.requires_grad
        need_dgrad = grad_enabled and ctx.needs_input_grad[0]
        # compiled, a signature a plan serves runs it as one op per pass (``compiled``)
        compiling = _compiling()
        ctx.op = (need_dgrad, need_wgrad) if compiling and plans.traceable(
            x2d, weight, cfg, out_dtype) else None
        # keep_input: x itself is kept between the passes, its columnwise copy made in the
        # backward pass (float8_block_linear); needless when no weight gradient follows.
        # Compiled, only the plan's ops keep it: on the general path x's quantize in the
        # backward pass reads x alone, so inductor's partitioner would run it in the forward
        # pass and keep its output anyway (``compiled``)
        keep = ctx.keep = keep_input and need_wgrad and (ctx.op is not None or not compiling)
        plan = None if compiling else plans.plan_for(
            x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad, keep)
        ctx.plan = plan
        # layers reading the same x reuse its FP8 copies inside a sharing scope (``sharing``)
        share = None if compiling else sharing.for_input(x, cfg, need_wgrad and not keep)
        if ctx.op is not None:
            y, qx_t = compiled.forward(x2d, weight, cfg, out_dtype, *ctx.op, keep)
        elif plan is not None:
            y, qx_t = plan.forward(x2d, weight, share)
        else:
            # low_memory_forward: x's rowwise copy made, used and freed before its columnwise
            # copy is made (fp8blk/torch/config.py); by default both in one fused pass
            lean = cfg.low_memory_forward
            cols = need_wgrad and not keep
            qx = (quantize_input(x2d, cfg.activation, cols and not lean) if share is None
                  else share("general", quantize_input, x2d, cfg.activation, cols))
            # The weight is asked for what each pass needs -- rowwise now, columnwise in the
            # backward pass -- and the weight itself is saved, not its FP8 buffers: an FSDP2
            # FP8 weight hands out what FSDP2 gathered for that pass (resharding after the
            # forward pass frees it: TransformerEngine's protocol), any other weight is
            # quantized again in backward, columnwise only. Keeping W's FP8 form until
            # backward would hold N*K bytes per layer through the whole forward pass of a
            # network, for one columnwise quantize saved.
            qw = weight_block_tensor(weight, cfg, True, False)
            y = blockwise_scaled_mm(*forward_operands(qx, qw, cfg), out_dtype=out_dtype)
            if lean:
                qx = qw = None
                if cols:
                    qx = quantize_buffers(x2d, cfg.activation, False, True)
            qx_t = transposed(qx, cfg.activation) if cols else (None, None)
        if bias is not None:
            y = add_bias(y, bias)
        # saved: x's columnwise FP8 buffers (keep_input: x itself) and W (a parameter: held
        # anyway)
        if keep:
            ctx.save_for_backward(x2d, None, weight)
        else:
            ctx.save_for_backward(qx_t[0], qx_t[1], weight)
        ctx.cfg = cfg
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias is not None)
        if x.dim() == 2:
            # not a view of y: FSDP2 warns that an in-place op on a module's view output
            # drops its pre-backward hook
            return y
        return y.reshape(*x.shape[:-1], y.shape[-1])

    # first-order only: the FP8 backward has no graph of its own, so a second-order graph
    # (create_graph=True, e.g. a gradient penalty) raises when it is differentiated
    # ("once_differentiable") instead of losing this layer's part silently
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        xt_d, xt_s, weight = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, has_bias = ctx.shapes
        dy2d = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # both paths sum dbias over the same contiguous dY: a strided sum adds in another order
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        x2d = None
        if ctx.keep:                    # xt_d holds x (M, K) itself
            x2d, xt_d = xt_d, None
            # the plan and the compiled op make x's columnwise copy from x themselves
            if need_wgrad and ctx.op is None and ctx.plan is None:
                xt_d, xt_s = transposed(quantize_buffers(x2d, ctx.cfg.activation, False, True),
                                        ctx.cfg.activation)
        if ctx.op is not None:
            dx, dw = compiled.backward(dy2d, xt_d, xt_s, weight, ctx.cfg, x_dtype, ctx.op,
                                       need_dgrad, need_wgrad, x2d)
        elif ctx.plan is not None:
            dx, dw = ctx.plan.backward(dy2d, xt_d, xt_s, weight, need_dgrad, need_wgrad, x2d)
        else:
            qw = weight_block_tensor(weight, ctx.cfg, False, True) if need_dgrad else None
            dx, dw = fp8_gemms_backward(dy2d, (xt_d, xt_s), qw, ctx.cfg, need_dgrad,
                                        need_wgrad, x_dtype, w_dtype)
        dbias = dy2d.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        if dx is not None and len(x_shape) != 2:
            dx = dx.reshape(x_shape)
        return dx, dw, dbias, None


def check_features(in_features, out_features, config):
    m = config.block_multiple
    if in_features % m or out_features % m:
        raise ValueError(f"{type(config.weight).__name__} needs in_features and out_features "
                         f"to be multiples of {m}, got ({in_features}, {out_features}); pad "
                         f"the layer or use the default Block1D/Block2D config")


def float8_block_linear(x, weight, bias=None, config: Float8BlockConfig = None, *,
                        keep_input: bool = False):
    """Functional form: ``F.linear(x, weight, bias)`` with the FP8 GEMMs described above.
    x (..., K) float32/bfloat16/float16; weight (N, K); bias (N,) or None. The output has x's
    dtype (the autocast dtype under ``torch.autocast``), dx x's dtype, dW the weight's.

    ``keep_input``: keep x itself between the passes (its storage: a non-contiguous x's
    contiguous copy) instead of its columnwise FP8 copy, which the backward pass then makes
    from x (the same bytes: every output and gradient is the default's). It saves M*K bytes
    where x is kept anyway -- by the op that made it, or by a caller that recomputes it in
    backward (``fp8blk.torch.recompute``) -- and costs M*K where nothing else keeps x. Under
    torch.compile, where the layer runs the plan's ops (CUDA, Block1D/Block2D, plain weights:
    ``fp8blk.torch.linear.compiled``), inductor's partitioner keeps x or recomputes it from
    what the graph keeps; elsewhere the compiled layer keeps the FP8 copy. An in-place change
    of x before the backward pass raises there (autograd's version check).

        import torch
        from fp8blk.torch import float8_block_linear
        x = torch.randn(256, 384, requires_grad=True)
        w = torch.randn(128, 384, requires_grad=True)
        float8_block_linear(x, w, keep_input=True).sum().backward()
    """
    config = config_or_default(config, "float8_block_linear")
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"float8_block_linear: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    if x.dim() == 0:
        raise ValueError("Float8BlockLinear: input must have at least 1 dimension (..., "
                         "in_features), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"Float8BlockLinear: weight must be 2-D (out_features, in_features), "
                         f"got shape {tuple(weight.shape)}")
    if x.dtype not in HIGH_DTYPES:
        raise TypeError(f"Float8BlockLinear: input dtype must be float32, bfloat16 or float16, "
                        f"got {x.dtype}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"Float8BlockLinear: input has {x.shape[-1]} features, the weight "
                         f"expects {weight.shape[-1]}")
    # under torch.autocast the output takes the autocast dtype, as F.linear's would, while x
    # and W are quantized in their own dtype, not cast to it first (TransformerEngine's
    # rule, docs/torch.md)
    device = x.device.type
    if device not in ("cuda", "cpu"):
        raise ValueError(f"Float8BlockLinear runs on CUDA or CPU tensors, got a {device} tensor")
    out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x.dtype)
    return _Float8BlockLinearFn.apply(x, weight, bias, (config, out_dtype,
                                                        torch.is_grad_enabled(),
                                                        bool(keep_input)))


__all__ = ["float8_block_linear", "add_bias", "fp8_gemms_backward", "quantize_input",
           "check_features", "weight_block_tensor", "forward_operands", "dgrad_operands", "wgrad_operands",
           "transposed", "weight_transposed", "quantize_buffers", "block2d_columnwise",
           "mxfp8_columnwise_as_rows", "block_tensor_buffers", "block_tensor_from_buffers"]
