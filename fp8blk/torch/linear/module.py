"""Float8BlockLinear, the ``nn.Linear`` whose three GEMMs run in block-scaled FP8 (the math,
memory and interfaces: docs/torch.md). The whole-model converter is :mod:`fp8blk.torch.convert`."""
from __future__ import annotations

import torch

from ...layout import c_strides
from ..config import Float8BlockConfig, config_or_default
from .functional import add_bias, check_features, float8_block_linear
from .hot import memo as _memo

_compiling = torch.compiler.is_compiling


class Float8BlockLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in block-scaled FP8 (see
    :mod:`fp8blk.torch.linear`). Same parameters and state dict as ``nn.Linear``.

    Under ``parallelize_module`` with torch's ColwiseParallel/RowwiseParallel (DTensor weights)
    the layer computes on the local shards and returns a DTensor with the placements the
    sharding implies (colwise: Shard(-1); rowwise: Partial, reduced before a bias is added).
    fp8blk's sequence-parallel styles (``fp8blk.torch.tensor_parallel``) set ``_fp8blk_tp``.

    ``keep_input``: what the layer keeps of its input between the passes: by default
    (False) x's columnwise FP8 copy; with True x itself, the FP8 copy made in the backward
    pass (``float8_block_linear(..., keep_input=True)``: the same bytes; M*K bytes fewer
    where x is kept anyway, M*K more where it is not). fp8blk's sequence-parallel styles keep
    the FP8 copy either way. ``convert_to_float8_block(..., keep_inputs=True)`` sets it
    where x is kept anyway.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 config: Float8BlockConfig = None):
        config = config_or_default(config, "Float8BlockLinear")
        check_features(in_features, out_features, config)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.config = config
        self._fp8blk_tp = None
        self._hot = None        # the memo of the last plan-served call (``hot``)
        self.keep_input = False

    @property
    def keep_input(self) -> bool:
        return self._keep_input

    @keep_input.setter
    def keep_input(self, value):
        if not isinstance(value, bool):
            raise TypeError(f"Float8BlockLinear.keep_input must be a bool, got {value!r}")
        self._keep_input = value

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: Float8BlockConfig = None):
        """A Float8BlockLinear sharing ``linear``'s parameters (no copy)."""
        config = config_or_default(config, "Float8BlockLinear.from_linear")
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"Float8BlockLinear.from_linear: linear must be a torch.nn.Linear, "
                            f"got {type(linear).__name__}")
        check_features(linear.in_features, linear.out_features, config)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                      config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x):
        if not _compiling():
            # eager: the memo of the last plan-served call (``hot``), else the general path
            # and a new memo where a plan serves the call
            if self._fp8blk_tp is None:
                weight, bias, cfg, keep = self.weight, self.bias, self.config, self._keep_input
                hot = self._hot
                y = None if hot is None else hot(x, weight, bias, cfg, keep)
                if y is None:
                    hot = self._hot = _memo(x, weight, cfg, keep)
                    y = None if hot is None else hot(x, weight, bias, cfg, keep)
                if y is not None:
                    return y
            return self._forward(x)
        if self._fp8blk_tp is not None or _fsdp_fp8_weight(self.weight):
            return _forward_eagerly(self, x)
        return self._forward(x)

    def _forward(self, x):
        if self._fp8blk_tp is not None:
            return self._fp8blk_tp.forward(self, x)
        if is_dtensor(self.weight):
            return dtensor_forward(self, x)
        return float8_block_linear(x, self.weight, self.bias, self.config,
                                   keep_input=self._keep_input)

    def __getstate__(self):
        # the memo holds driver objects (descriptors, parameter blocks): a copy makes its own
        state = self.__dict__.copy()
        state["_hot"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_hot", None)

    def extra_repr(self):
        keep = ", keep_input=True" if self._keep_input else ""
        return f"{super().extra_repr()}, config={self.config!r}{keep}"


def _fsdp_fp8_weight(weight) -> bool:
    """Whether `weight` is FSDP2's unsharded FP8 weight
    (fp8blk.torch.fsdp.weights.Float8BlockWeight), or a DTensor of one (FSDP2 x TP)."""
    local = weight._local_tensor if is_dtensor(weight) else weight
    return hasattr(local, "fp8blk_block_tensor")


# Under torch.compile a layer whose weight is an FSDP2 FP8 weight, or that runs an fp8blk
# sequence-parallel style, runs eagerly (a graph break). Dynamo does not trace the weight
# subclass: the traced layer loses the weight's requires_grad -- no weight gradient, silently,
# in every backend (eager, aot_eager, inductor). The styles' FP8 all-gather crosses into
# CuPy/NumPy arrays, which fake tensors cannot (dynamo raises)
_forward_eagerly = torch.compiler.disable(Float8BlockLinear._forward)



# DTensor weights (torch's tensor-parallel plans): the FP8 GEMMs run on the local shards and the
# output is re-wrapped with the placements the weight's sharding implies (docs/torch.md).
# torch.distributed is imported only when a DTensor weight is first seen.

def is_dtensor(t) -> bool:
    # by type name: importing torch.distributed.tensor costs time and is not always available
    return type(t).__name__ == "DTensor"


def _shard_dim(placement, ndim):
    if not placement.is_shard():
        return None
    return placement.dim % ndim


def _local(x, want, mesh, what):
    """x's local tensor, checking a DTensor input has the placement the layer needs."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return x, False
    if len(x.placements) != 1 or x.device_mesh != mesh:
        raise ValueError(f"Float8BlockLinear ({what}): the input must be a DTensor on the "
                         f"weight's 1-D mesh, got placements {x.placements}")
    p = x.placements[0]
    ok = p.is_replicate() if want == "replicate" else _shard_dim(p, x.ndim) == x.ndim - 1
    if not ok:
        raise ValueError(f"Float8BlockLinear ({what}): the input must be "
                         f"{'Replicate' if want == 'replicate' else 'Shard(-1)'}, got {p}")
    return x, True


def dtensor_forward(layer, x):
    """Forward of a Float8BlockLinear whose weight is a DTensor (torch's TP plans)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    w = layer.weight
    mesh = w.device_mesh
    if len(w.placements) != 1:
        raise NotImplementedError("Float8BlockLinear supports DTensor weights on 1-D meshes "
                                  f"(tensor parallelism), got placements {w.placements}")
    p, b, cfg = w.placements[0], layer.bias, layer.config
    keep = layer.keep_input
    dim = _shard_dim(p, 2)
    if dim == 0:                                   # column-wise
        x, is_dt = _local(x, "replicate", mesh, "column-wise")
        # the input gradient computed from this rank's output columns is a partial sum
        x_local = x.to_local(grad_placements=[Partial()]) if is_dt else x
        y = float8_block_linear(x_local, w.to_local(),
                                None if b is None else b.to_local(), cfg, keep_input=keep)
        # the global shape given explicitly: out_features need not split evenly
        shape = (*y.shape[:-1], layer.out_features)
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False,
                                  shape=torch.Size(shape), stride=c_strides(shape))
    if dim == 1:                                   # row-wise
        x, is_dt = _local(x, "shard", mesh, "row-wise")
        x_local = x.to_local() if is_dt else x
        y = float8_block_linear(x_local, w.to_local(), None, cfg, keep_input=keep)
        y = DTensor.from_local(y, mesh, [Partial()], run_check=False)
        if b is not None:
            # the bias rounded to y's dtype first (the autocast dtype under autocast), as
            # the unsharded layer adds it: on the local tensors, since the compiled rounding
            # op has no DTensor sharding rule
            y = y.redistribute(mesh, [Replicate()])
            y = DTensor.from_local(add_bias(y.to_local(), b.to_local()), mesh, [Replicate()],
                                   run_check=False)
        return y
    if p.is_replicate():
        x_local = x.to_local() if isinstance(x, DTensor) else x
        y = float8_block_linear(x_local, w.to_local(), None if b is None else b.to_local(),
                                cfg, keep_input=keep)
        return DTensor.from_local(y, mesh, [Replicate()], run_check=False)
    raise NotImplementedError(f"Float8BlockLinear: weight placement {p} is not supported")


__all__ = ["Float8BlockLinear", "dtensor_forward", "is_dtensor"]
