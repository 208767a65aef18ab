"""Float8BlockLinear: ``nn.Linear`` with its three GEMMs in block-scaled FP8, and
``convert_to_float8_block`` to swap a model's ``nn.Linear`` modules in place.

Math (TransformerEngine's block-scaling recipe, DESIGN §8), for x (..., K) viewed as (M, K),
W (N, K), dY (M, N):

    forward   y  = x[1x128] @ W[128x128].T            (+ bias in high precision)
    dgrad     dx = dY[1x128] @ W.columnwise[128x128]  (FP8 transpose of W's tiles, no requant)
    wgrad     dW = dY.columnwise[128x1].T @ x.columnwise[128x1]   (reduction over tokens)

x and dY are each quantized ONCE, rowwise and columnwise in one fused pass. The activation
saved for the backward pass is x's columnwise FP8 buffer (M*K bytes plus scales), not the
high-precision x (2*M*K bytes in bf16): about half the activation memory of nn.Linear. W's
rowwise FP8 buffers (N*K bytes) are saved too, so the backward pass needs no requantization.
Output dtype = x's dtype; dW is produced in W's dtype, dbias = dY summed over tokens.

Interface with the FSDP2 weight subclass (``fp8blk/torch/fsdp.py``): the layer gets its
quantized weight only through :func:`_weight_block_tensor`. A weight with a method
``fp8blk_block_tensor(rowwise: bool, columnwise: bool) -> fp8blk.BlockTensor`` (Block2D, or
MXFP8 under an MXFP8 config; the recipe must equal ``config.weight``) is asked for its FP8 form
and used as it is (no requantization); any other weight is quantized from its high-precision
values. The forward pass asks for ``rowwise=True, columnwise=False`` (Block2D; MXFP8 asks for
both, since its columnwise blocks differ); the backward pass derives the columnwise buffers by
FP8 transpose. The weight is an input of the autograd function either way, so dW flows to it.

torch.compile: quantize, transpose and GEMM are custom ops with fake implementations, so
``torch.compile(model, fullgraph=True)`` traces the layer without graph breaks (plain weights;
the FSDP2 hook path is eager-only).

    import torch, fp8blk as fb
    from fp8blk.torch import convert_to_float8_block
    model = torch.nn.Sequential(torch.nn.Linear(384, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 320))
    convert_to_float8_block(model)          # in place; Float8BlockConfig() by default
    y = model(torch.randn(8, 32, 384))
    y.sum().backward()
"""
from __future__ import annotations

import torch

from ..formats import MXFP8
from .config import Float8BlockConfig
from .quantize_ops import (FP8_DTYPE, block2d_columnwise, block_tensor_buffers,
                           mxfp8_columnwise_as_rows, quantize_buffers)
from .scaled_mm import blockwise_scaled_mm

_HIGH = (torch.float32, torch.bfloat16, torch.float16)


def _blocks(recipe) -> str:
    return "1x32" if isinstance(recipe, MXFP8) else (
        "128x128" if type(recipe).__name__ == "Block2D" else "1x128")


def _f8(data, recipe):
    return data.view(FP8_DTYPE[recipe.fmt])


def _weight_block_tensor(weight, config: Float8BlockConfig, rowwise: bool, columnwise: bool):
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
    if w.dtype not in _HIGH:
        raise TypeError(f"Float8BlockLinear: weight dtype must be float32, bfloat16 or float16, "
                        f"got {w.dtype}")
    return quantize_buffers(w.contiguous(), config.weight, rowwise, columnwise)


# operand selection of each GEMM: one function each, so tests can check (and plant bugs in)
# exactly one choice at a time
def _forward_operands(qx, qw, cfg):
    """(a, a_sinv, b, b_sinv, a_blocks, b_blocks) of y = x @ W.T."""
    return (_f8(qx[0], cfg.activation), qx[1], _f8(qw[0], cfg.weight), qw[1],
            _blocks(cfg.activation), _blocks(cfg.weight))


def _dgrad_operands(qdy, qw_t, cfg):
    """dx = dY @ W: b is W's columnwise buffer (K, N), the FP8 transpose."""
    return (_f8(qdy[0], cfg.grad), qdy[1], _f8(qw_t[0], cfg.weight), qw_t[1],
            _blocks(cfg.grad), _blocks(cfg.weight))


def _wgrad_operands(qdy_t, qx_t, cfg):
    """dW = dY.T @ x over tokens: both operands are the columnwise (transposed, 128x1)
    buffers, dY.T (N, M) and x.T (K, M)."""
    return (_f8(qdy_t[0], cfg.grad), qdy_t[1], _f8(qx_t[0], cfg.activation), qx_t[1],
            _blocks(cfg.grad), _blocks(cfg.activation))


def _transposed(buffers, recipe):
    """Columnwise buffers of a quantized tensor as the rowwise buffers of its transpose."""
    if isinstance(recipe, MXFP8):
        return mxfp8_columnwise_as_rows(buffers[2], buffers[3])
    return buffers[2], buffers[3]


def _weight_transposed(qw, recipe):
    if isinstance(recipe, MXFP8):
        return mxfp8_columnwise_as_rows(qw[2], qw[3])
    if qw[2].numel():                       # the FSDP weight may hand columnwise buffers
        return qw[2], qw[3]
    return block2d_columnwise(qw[0], qw[1], recipe)


def quantize_input(x2d, recipe, need_columnwise):
    return quantize_buffers(x2d, recipe, True, need_columnwise)


def fp8_gemms_backward(dy2d, qx_t, qw, cfg, need_dgrad, need_wgrad, dx_dtype, dw_dtype,
                       qdy=None):
    """(dx (M, K) or None, dW (N, K) or None) from dY (M, N). ``qdy``: dY's buffers when the
    caller already has them (the sequence-parallel FP8 gather)."""
    if qdy is None:
        qdy = quantize_buffers(dy2d, cfg.grad, need_dgrad, need_wgrad)
    dx = dw = None
    if need_dgrad:
        dx = blockwise_scaled_mm(*_dgrad_operands(qdy, _weight_transposed(qw, cfg.weight), cfg),
                                 out_dtype=dx_dtype)
    if need_wgrad:
        dw = blockwise_scaled_mm(*_wgrad_operands(_transposed(qdy, cfg.grad), qx_t, cfg),
                                 out_dtype=dw_dtype)
    return dx, dw


class _Float8BlockLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cfg):
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        need_wgrad = weight.requires_grad
        qx = quantize_input(x2d, cfg.activation, need_wgrad)
        qw = _weight_block_tensor(weight, cfg, True, isinstance(cfg.weight, MXFP8))
        y = blockwise_scaled_mm(*_forward_operands(qx, qw, cfg), out_dtype=x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        qx_t = _transposed(qx, cfg.activation) if need_wgrad else (None, None)
        # FP8 saved: x's columnwise buffers and W's buffers, nothing in high precision
        ctx.save_for_backward(qx_t[0], qx_t[1], *qw)
        ctx.cfg = cfg
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias is not None)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xt_d, xt_s, *qw = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, has_bias = ctx.shapes
        n = dy.shape[-1]
        dy2d = dy.reshape(-1, n)
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = fp8_gemms_backward(dy2d, (xt_d, xt_s), qw, ctx.cfg, need_dgrad, need_wgrad,
                                    x_dtype, w_dtype)
        dbias = dy2d.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        if dx is not None:
            dx = dx.reshape(x_shape)
        return dx, dw, dbias, None


def check_features(in_features, out_features, config):
    m = config.block_multiple
    if in_features % m or out_features % m:
        raise ValueError(f"{type(config.weight).__name__} needs in_features and out_features "
                         f"to be multiples of {m}, got ({in_features}, {out_features}); pad "
                         f"the layer or use the default Block1D/Block2D config")


def float8_block_linear(x, weight, bias=None, config: Float8BlockConfig = None):
    """Functional form: ``F.linear(x, weight, bias)`` with the FP8 GEMMs described above.
    x (..., K) float32/bfloat16/float16; weight (N, K); bias (N,) or None."""
    config = config or Float8BlockConfig()
    if x.dtype not in _HIGH:
        raise TypeError(f"Float8BlockLinear: input dtype must be float32, bfloat16 or float16, "
                        f"got {x.dtype}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"Float8BlockLinear: input has {x.shape[-1]} features, the weight "
                         f"expects {weight.shape[-1]}")
    return _Float8BlockLinearFn.apply(x, weight, bias, config)


class Float8BlockLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in block-scaled FP8 (see the module
    docstring). Same parameters and state dict as ``nn.Linear``.

    Under ``parallelize_module`` with torch's ColwiseParallel/RowwiseParallel (DTensor weights)
    the layer computes on the local shards and returns a DTensor with the placements the
    sharding implies (colwise: Shard(-1); rowwise: Partial, reduced before a bias is added).
    fp8blk's sequence-parallel styles (``fp8blk.torch.parallel``) set ``_fp8blk_tp``.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 config: Float8BlockConfig = None):
        config = config or Float8BlockConfig()
        check_features(in_features, out_features, config)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.config = config
        self._fp8blk_tp = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: Float8BlockConfig = None):
        """A Float8BlockLinear sharing ``linear``'s parameters (no copy)."""
        config = config or Float8BlockConfig()
        check_features(linear.in_features, linear.out_features, config)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                      config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x):
        if self._fp8blk_tp is not None:
            return self._fp8blk_tp.forward(self, x)
        if _is_dtensor(self.weight):
            from .tensor_parallel import dtensor_forward

            return dtensor_forward(self, x)
        return float8_block_linear(x, self.weight, self.bias, self.config)

    def extra_repr(self):
        return f"{super().extra_repr()}, config={self.config!r}"


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def convert_to_float8_block(model: torch.nn.Module, config: Float8BlockConfig = None,
                            module_filter_fn=None) -> torch.nn.Module:
    """Swap every ``nn.Linear`` in ``model`` (and ``model`` itself) for a Float8BlockLinear
    sharing its parameters, in place. ``module_filter_fn(module, fqn) -> bool`` chooses which
    (default: all whose features the recipe allows; MXFP8 skips layers whose features are not
    multiples of 32 only if a filter says so, else raises). Returns ``model``."""
    config = config or Float8BlockConfig()

    def swap(module, fqn):
        if type(module) is torch.nn.Linear and (module_filter_fn is None
                                                or module_filter_fn(module, fqn)):
            return Float8BlockLinear.from_linear(module, config)
        for name, child in list(module.named_children()):
            new = swap(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                setattr(module, name, new)
        return module

    out = swap(model, "")
    if out is not model:
        raise TypeError("convert_to_float8_block converts in place; pass a model that "
                        "contains nn.Linear modules, not an nn.Linear itself (use "
                        "Float8BlockLinear.from_linear(linear))")
    return model


__all__ = ["Float8BlockLinear", "convert_to_float8_block", "float8_block_linear",
           "_weight_block_tensor"]
