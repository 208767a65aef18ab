"""Float8BlockLinear under torch's tensor-parallel plans (DTensor weights): the FP8 GEMMs run on
the local shards and the output is re-wrapped with the placements the weight's sharding
implies (see :mod:`fp8blk.torch.tensor_parallel` for the full description). torch.distributed
is imported only when a DTensor weight is first seen.
"""
from __future__ import annotations

import torch

from ...layout import c_strides
from .functional import add_bias, float8_block_linear


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


__all__ = ["dtensor_forward", "is_dtensor"]
