"""A Float8BlockLinear's memo of its last call, and the lean autograd Function it runs.

A layer call on the general path (``functional``) checks its operands, works out the call's
settings (output dtype, which gradients, what to keep), views an N-D input as 2-D, keys and
looks up its plan (``plans``), and goes through an autograd Function that serves every
path. Training calls a layer with the same signature step after step, so the layer keeps a
:class:`Hot` memo of its last plan-served call (``Float8BlockLinear.forward``): when the next
call matches it -- the same weight object still of the dtype, shape, device, contiguity and
alignment the plan was made for; x a plain tensor of the same shape, dtype, device and
``requires_grad``, C-contiguous and 16-byte aligned; the same grad mode, autocast state,
config and ``keep_input``; eager -- the call goes straight to :class:`_HotFn` with the plan's
lean path (``plans._Lean``) and no view of x, y, dY or dx (the plan's other path, with 2-D
views, where the lean one does not serve the call or the plan has none). Anything else takes
the general path, which makes a new memo where a plan serves it.

The bytes are the general path's: the same plan, the same buffers, the same GEMMs; the bias
added with ``functional.add_bias`` and its gradient summed over the 2-D dY as there
(tests/torch/linear/test_plans.py compares the two on the GPU).

    layer = Float8BlockLinear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    layer(x)            # general path; the layer keeps a memo
    layer(x)            # the memo's path
"""
from __future__ import annotations

import torch

from ...layout import c_strides
from . import plans, sharing
from .functional import add_bias

_Tensor = torch.Tensor
_WEIGHTS = (torch.Tensor, torch.nn.Parameter)    # not DTensors, not FSDP2's FP8 weight
_grad_enabled = torch.is_grad_enabled
_autocast_enabled = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype


class Hot:
    """The memo of one layer call signature that a plan's lean path serves. ``hot(x,
    weight, bias, config, keep_input)`` runs the layer when the call matches the memo (module
    docstring) and returns None when it does not. Made by :func:`memo`."""

    __slots__ = ("weight", "w_shape", "w_dtype", "w_grad", "x_shape", "x_dtype", "x_grad",
                 "index", "grad", "autocast", "out_dtype", "cfg", "keep_input", "plan", "lean",
                 "keep", "cols", "y_spec", "dx_spec", "x2d_shape", "n")

    def __call__(self, x, weight, bias, cfg, keep_input):
        if (weight is not self.weight or cfg is not self.cfg
                or keep_input is not self.keep_input or type(x) is not _Tensor
                or x.shape != self.x_shape or x.dtype is not self.x_dtype
                or x.get_device() != self.index or x.requires_grad is not self.x_grad
                or not x.is_contiguous() or x.data_ptr() & 15
                or _grad_enabled() is not self.grad
                or weight.dtype is not self.w_dtype or weight.shape != self.w_shape
                or weight.get_device() != self.index or weight.requires_grad is not self.w_grad
                or not weight.is_contiguous() or weight.data_ptr() & 15):
            return None
        if _autocast_enabled("cuda"):
            if not self.autocast or _autocast_dtype("cuda") is not self.out_dtype:
                return None
        elif self.autocast:
            return None
        return _HotFn.apply(x, weight, bias, self)


def memo(x, weight, cfg, keep_input):
    """A :class:`Hot` for this call of a layer (weight `weight`, config `cfg`), or None where
    no plan serves it (CPU, MXFP8, FSDP2 FP8 or DTensor weights, tensor subclasses,
    non-contiguous or unaligned operands, empty inputs, ...)."""
    if type(x) is not _Tensor or type(weight) not in _WEIGHTS or not x.is_cuda \
            or x.dim() == 0 or not x.is_contiguous() or weight.dim() != 2 \
            or x.shape[-1] != weight.shape[-1]:
        return None
    autocast = _autocast_enabled("cuda")
    out_dtype = _autocast_dtype("cuda") if autocast else x.dtype
    grad = _grad_enabled()
    need_wgrad = grad and weight.requires_grad
    need_dgrad = grad and x.requires_grad
    keep = bool(keep_input) and need_wgrad
    x2d = x.view(-1, x.shape[-1])
    plan = plans.plan_for(x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad, keep)
    if plan is None:
        return None
    hot = Hot()
    hot.weight, hot.w_shape, hot.w_dtype = weight, weight.shape, weight.dtype
    hot.w_grad, hot.x_shape, hot.x_dtype = weight.requires_grad, x.shape, x.dtype
    hot.x_grad, hot.index, hot.grad = x.requires_grad, x.get_device(), grad
    hot.autocast, hot.out_dtype, hot.cfg, hot.keep_input = autocast, out_dtype, cfg, keep_input
    hot.plan, hot.lean, hot.keep, hot.cols = plan, plan.lean, keep, need_wgrad and not keep
    n = hot.n = weight.shape[0]
    y_shape = tuple(x.shape[:-1]) + (n,)
    hot.y_spec = (y_shape, c_strides(y_shape), out_dtype)
    hot.dx_spec = (tuple(x.shape), c_strides(tuple(x.shape)), x.dtype)
    hot.x2d_shape = tuple(x2d.shape)
    return hot


class _HotFn(torch.autograd.Function):
    """``functional._Float8BlockLinearFn`` for a call a :class:`Hot` serves: x, W, bias and
    the memo in, y out; in between what the plan's lean path does (its other path where the
    lean one does not serve the call or the plan has none: ``low_memory_forward``, GEMMs on
    ``torch._scaled_mm``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, hot):
        share = sharing.for_input(x, hot.cfg, hot.cols)
        lean = hot.lean
        out = None if lean is None else lean.forward(x, weight, share, hot.y_spec)
        if out is None:
            y, saved = hot.plan.forward(x.view(hot.x2d_shape), weight, share)
            y = y.view(hot.y_spec[0])
        else:
            y, saved = out
        if bias is not None:
            y = add_bias(y, bias)
        if hot.keep:
            ctx.save_for_backward(x, None, weight)
        else:
            ctx.save_for_backward(saved[0], saved[1], weight)
        ctx.hot = hot
        return y

    @staticmethod
    def backward(ctx, dy):
        if _grad_enabled():     # create_graph=True: first-order only, as the general path
            return _backward_once(ctx, dy)
        return _backward(ctx, dy)


def _backward(ctx, dy):
    xt_d, xt_s, weight = ctx.saved_tensors
    hot = ctx.hot
    need_dgrad, need_wgrad, need_dbias = ctx.needs_input_grad[:3]
    # the general path's dY: contiguous, 16-byte aligned (dbias summed over the same bytes)
    if not dy.is_contiguous():
        dy = dy.contiguous()
    if dy.data_ptr() & 15:
        dy = dy.clone(memory_format=torch.contiguous_format)
    dx = dw = x = None
    if hot.keep:                        # xt_d holds x itself
        x, xt_d = xt_d, None
    if need_dgrad or need_wgrad:
        lean = hot.lean
        out = None if lean is None else lean.backward(dy, xt_d, xt_s, weight, need_dgrad,
                                                      need_wgrad, x, hot.dx_spec)
        if out is None:
            m = hot.x2d_shape[0]
            dx, dw = hot.plan.backward(dy.view(m, hot.n), xt_d, xt_s, weight, need_dgrad,
                                       need_wgrad, None if x is None else x.view(hot.x2d_shape))
            if dx is not None:
                dx = dx.view(hot.dx_spec[0])
        else:
            dx, dw = out
    dbias = dy.view(-1, hot.n).sum(0) if need_dbias else None
    return dx, dw, dbias, None


# under create_graph=True: the FP8 backward has no graph of its own, so differentiating its
# outputs raises ("once_differentiable") instead of losing this layer's part silently
_backward_once = torch.autograd.function.once_differentiable(_backward)


__all__ = ["Hot", "memo"]
