"""Tensor and sequence parallelism for Float8BlockLinear.

Two ways in:

1. torch's own plans: ``parallelize_module(model, mesh, {"w1": ColwiseParallel(),
   "out_proj": RowwiseParallel()})`` on a converted model. The weights become DTensors and
   :func:`dtensor_forward` runs the FP8 GEMMs on the local shards (no DTensor sharding
   strategy is registered for ``blockwise_scaled_mm``; the layer unwraps and rewraps):
   column-wise (weight Shard(0)): input Replicate -> output Shard(-1), the input gradient is a
   Partial sum reduced by DTensor; row-wise (weight Shard(1)): input Shard(-1) -> output
   Partial, reduced (to Replicate) before a bias is added, else left for the plan's output
   layouts to reduce.
2. fp8blk's sequence-parallel styles, :class:`Float8BlockColwiseSequenceParallel` and
   :class:`Float8BlockRowwiseSequenceParallel` (1-D mesh; sequence-first inputs: the sequence
   is sharded along dim 0, e.g. (S/tp, B, K) as in Megatron/TE; the layer's input and output
   are plain local tensors):

   * column-wise: the local input (S/tp, ..., K) is quantized locally and all-gathered in FP8
     with ``fb.comm.gather_along_first_dim`` on a ``TorchComm`` of the mesh's group (rowwise
     for the forward GEMM and columnwise for the weight gradient, one gather). Where the
     local token count (S/tp * B) is not a multiple of 128, 128x1 columnwise blocks would
     cross ranks and the gather falls back to a high-precision gather itself
     (``comm.stats.last_gather_path`` says which ran). Output (S, ..., N/tp). The gathered
     columnwise FP8 x (S*B*K bytes plus scales) is what the layer saves for backward.
     Backward: the input gradient (S, ..., K) (a partial sum) is reduce-scattered along
     dim 0. Traffic: the FP8 gather sends rowwise and columnwise bytes, ~2 bytes per element
     (as much as a bf16 gather, half of fp32); what it saves is the quantization work, done
     on the local shard only (the fallback sends the input's own dtype).
   * row-wise: input (S, ..., K/tp) -> partial output (S, ..., N) reduce-scattered along dim
     0 to (S/tp, ..., N), then the bias. Backward: the output gradient (S/tp, ..., N) is
     all-gathered in FP8 the same way (rowwise for dgrad, columnwise for wgrad); the bias
     gradient is all-reduced.

   The partial sums (row-wise output, column-wise input gradient) are reduced in the input's
   dtype, as TE does. Every rank must hold the same number of tokens (the reduce-scatter
   splits evenly). The result equals the unsharded layer's: the gathered FP8 tensor is
   ``quantize`` of the concatenated input byte for byte, and shards whose boundaries fall on
   multiples of 128 features quantize the weight's 128x128 tiles exactly as the whole weight.

    from torch.distributed.tensor.parallel import parallelize_module
    from fp8blk.torch.tensor_parallel import (Float8BlockColwiseSequenceParallel,
                                              Float8BlockRowwiseSequenceParallel)
    parallelize_module(ffn, mesh, {"w1": Float8BlockColwiseSequenceParallel(),
                                   "w2": Float8BlockColwiseSequenceParallel(),
                                   "out_proj": Float8BlockRowwiseSequenceParallel()})
    y_local = ffn(x_local)        # x_local: (S/tp, B, d) on every rank
"""
from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..comm import TorchComm, gather_along_first_dim
from ..comm.agree import all_agree, fingerprint
from .linear import Float8BlockLinear
from .linear.module import dtensor_forward  # noqa: F401 (re-exported)
from .linear.functional import (add_bias, forward_operands, fp8_gemms_backward,
                                quantize_input, transposed, weight_block_tensor)
from .linear.functional import block_tensor_buffers
from .scaled_mm import blockwise_scaled_mm


# ---------------------------------------------------------------------------------------------
# sequence parallelism


def _save_for_backward(ctx, x, weight, bias, qx, qw, cfg, comm, need_wgrad):
    """What both sequence-parallel functions keep for backward: x's columnwise FP8 buffers
    (when the weight gradient is needed), W itself (its columnwise FP8 form is made in
    backward, as in ``functional``), the config, comm and shapes."""
    qx_t = transposed(qx, cfg.activation) if need_wgrad else (None, None)
    ctx.save_for_backward(qx_t[0], qx_t[1], weight)
    ctx.cfg, ctx.comm = cfg, comm
    ctx.meta = (x.shape, x.dtype, weight.dtype, bias is not None)


class _ColwiseSPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cfg, comm, out_dtype):
        k = x.shape[-1]
        x2d = x.reshape(-1, k).contiguous()
        need_wgrad = weight.requires_grad
        # every rank holds the same token count (the backward reduce-scatter needs it):
        # sizes= lets the gather skip its metadata exchange after the first, checked call
        qx, _ = gather_along_first_dim(x2d, comm, cfg.activation, rowwise=True,
                                       columnwise=need_wgrad,
                                       sizes=[x2d.shape[0]] * comm.size)
        qx = block_tensor_buffers(qx)
        qw = weight_block_tensor(weight, cfg, True, False)
        y = blockwise_scaled_mm(*forward_operands(qx, qw, cfg), out_dtype=out_dtype)
        if bias is not None:
            y = add_bias(y, bias)
        _save_for_backward(ctx, x, weight, bias, qx, qw, cfg, comm, need_wgrad)
        if y.shape[0] != x2d.shape[0] * comm.size:   # the reduce-scatter splits evenly
            raise ValueError(f"sequence parallelism needs the same token count on every rank; "
                             f"this rank has {x2d.shape[0]} of {y.shape[0]}")
        return y.reshape(x.shape[0] * comm.size, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable      # first-order only, as the layer's
    def backward(ctx, dy):
        xt_d, xt_s, weight = ctx.saved_tensors
        qw = weight_block_tensor(weight, ctx.cfg, False, True)
        x_shape, x_dtype, w_dtype, has_bias = ctx.meta
        dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = fp8_gemms_backward(dy2d, (xt_d, xt_s), qw, ctx.cfg, need_dgrad, need_wgrad,
                                    x_dtype, w_dtype)
        if dx is not None:
            dx = ctx.comm.reduce_scatter(dx).reshape(x_shape)
        dbias = dy2d.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, dbias, None, None, None


class _RowwiseSPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cfg, comm, out_dtype):
        k = x.shape[-1]
        x2d = x.reshape(-1, k).contiguous()
        if x2d.shape[0] % comm.size:
            raise ValueError(f"sequence parallelism: {x2d.shape[0]} tokens do not split "
                             f"evenly over {comm.size} ranks")
        need_wgrad = weight.requires_grad
        qx = quantize_input(x2d, cfg.activation, need_wgrad)
        qw = weight_block_tensor(weight, cfg, True, False)
        partial = blockwise_scaled_mm(*forward_operands(qx, qw, cfg), out_dtype=out_dtype)
        y = comm.reduce_scatter(partial)
        if bias is not None:
            y = add_bias(y, bias)
        _save_for_backward(ctx, x, weight, bias, qx, qw, cfg, comm, need_wgrad)
        return y.reshape(x.shape[0] // comm.size, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable      # first-order only, as the layer's
    def backward(ctx, dy):
        xt_d, xt_s, weight = ctx.saved_tensors
        qw = weight_block_tensor(weight, ctx.cfg, False, True)
        x_shape, x_dtype, w_dtype, has_bias = ctx.meta
        cfg, comm = ctx.cfg, ctx.comm
        dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qdy = None
        if need_dgrad or need_wgrad:
            # the FP8 all-gather of dY: rowwise for dgrad, columnwise (128x1) for wgrad
            qdy, _ = gather_along_first_dim(dy2d, comm, cfg.grad, rowwise=need_dgrad,
                                            columnwise=need_wgrad,
                                            sizes=[dy2d.shape[0]] * comm.size)
            qdy = block_tensor_buffers(qdy)
        dx, dw = fp8_gemms_backward(None, (xt_d, xt_s), qw, cfg, need_dgrad, need_wgrad,
                                    x_dtype, w_dtype, qdy=qdy)
        if dx is not None:
            dx = dx.reshape(x_shape)
        dbias = None
        if has_bias and ctx.needs_input_grad[2]:
            dbias = dy2d.sum(0)
            comm.all_reduce(dbias)
        return dx, dw, dbias, None, None, None


# id(group) -> TorchComm, held weakly: a module-level strong reference would keep every group
# (and its gloo/NCCL threads) alive until interpreter finalization, past destroy_process_group,
# where gloo's teardown can abort. An entry's comm holds its group, so the id is not reused
# while the entry exists
_COMMS = weakref.WeakValueDictionary()


def comm_for(mesh) -> TorchComm:
    """The one TorchComm of a 1-D mesh's process group (shared by every layer on it, so
    ``comm_for(mesh).stats`` counts all their traffic), kept while a layer or caller holds it."""
    group = mesh.get_group()
    comm = _COMMS.get(id(group))
    if comm is None:
        comm = _COMMS[id(group)] = TorchComm(group)
    return comm


class _SequenceParallel:
    """What an SP style attaches to a layer (``layer._fp8blk_tp``)."""

    def __init__(self, fn, mesh):
        self.fn, self.mesh = fn, mesh
        self.comm = comm_for(mesh)
        self.shapes = set()          # local input shapes every rank was found to hold

    def forward(self, layer, x):
        if isinstance(x, DTensor):
            raise TypeError("fp8blk's sequence-parallel styles take plain local tensors "
                            "(the rank's sequence shard), not DTensors")
        if x.dim() < 2:
            raise ValueError(f"fp8blk's sequence-parallel styles take (S/tp, ..., K) or "
                             f"(S, ..., K/tp) inputs, got shape {tuple(x.shape)}")
        self.check_shape(tuple(x.shape))
        w, b = layer.weight, layer.bias
        # under torch.autocast the output takes the autocast dtype, as the unsharded layer's
        device = x.device.type
        out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else x.dtype)
        return self.fn.apply(x, w.to_local(), None if b is None else b.to_local(),
                             layer.config, self.comm, out_dtype)

    def check_shape(self, shape):
        """Every rank must hold an input of the same shape: each rank reshapes the gathered
        (or reduce-scattered) tokens with its own (sequence, batch) split, so equal token
        counts in other splits would give wrong outputs silently. Checked with one small
        all-reduce the first time a layer sees a shape (every rank raises when they differ);
        a rank changing its split while the others keep a checked one is not caught."""
        if shape in self.shapes:
            return
        agreement = all_agree(self.comm, [fingerprint(shape)],
                              reduce_max=self.comm.meta_all_reduce_max)
        if not agreement.same():
            raise ValueError(f"fp8blk's sequence-parallel styles need the same local input "
                             f"shape on every rank; the ranks hold different ones (this rank "
                             f"{shape}, rank {self.comm.rank} of {self.comm.size})")
        self.shapes.add(shape)


class _Float8BlockSequenceParallel(ParallelStyle):
    _weight_dim = None
    _bias_sharded = None
    _fn = None

    def _apply(self, module, device_mesh):
        if not isinstance(module, Float8BlockLinear):
            raise TypeError(f"{type(self).__name__} applies to Float8BlockLinear modules "
                            f"(convert_to_float8_block first), got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"{type(self).__name__} needs a 1-D mesh, got {device_mesh}")
        module.weight = torch.nn.Parameter(
            distribute_tensor(module.weight.data, device_mesh, [Shard(self._weight_dim)]),
            requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            placement = Shard(0) if self._bias_sharded else Replicate()
            module.bias = torch.nn.Parameter(
                distribute_tensor(module.bias.data, device_mesh, [placement]),
                requires_grad=module.bias.requires_grad)
        module._fp8blk_tp = _SequenceParallel(self._fn, device_mesh)
        return module


class Float8BlockColwiseSequenceParallel(_Float8BlockSequenceParallel):
    """Column-parallel Float8BlockLinear with a sequence-sharded input: (S/tp, ..., K) in,
    (S, ..., N/tp) out; FP8 all-gather of the input (see the module docstring)."""

    _weight_dim, _bias_sharded, _fn = 0, True, _ColwiseSPFn


class Float8BlockRowwiseSequenceParallel(_Float8BlockSequenceParallel):
    """Row-parallel Float8BlockLinear with a sequence-sharded output: (S, ..., K/tp) in,
    (S/tp, ..., N) out by reduce-scatter; FP8 all-gather of the output gradient."""

    _weight_dim, _bias_sharded, _fn = 1, False, _RowwiseSPFn


__all__ = ["dtensor_forward", "comm_for", "Float8BlockColwiseSequenceParallel",
           "Float8BlockRowwiseSequenceParallel"]
