"""Checkpoints of models with FSDP2 FP8 weights (docs/torch.md, "Checkpoints").

``model.state_dict()`` of a model prepared by :func:`fp8blk.torch.prepare_fsdp_fp8` saves with
``torch.distributed.checkpoint`` (DCP) or ``torch.save``: each FP8 weight's local shard is
stored as a plain tensor of its high-precision values (mode "cast": the parameter; mode
"primary": the FP8 weight dequantized with its global scales), so any model -- an unconverted
bf16 one too -- loads the checkpoint. Loading it into a mode "cast" model writes the
parameters, and the next all-gather re-casts them.

In mode "primary" the fp32 masters are what training resumes from; they are not module
parameters, so :func:`master_state_dict` presents them (and the optimizer's state of each) as
DTensors with FSDP2's sharding of their weight, keyed by the weight's name: DCP saves them
as one global tensor per weight and loads them in place, at any world size. Resume:

    masters = fsdp.master_weights(model)
    opt = torch.optim.AdamW(masters, lr=1e-3)
    dcp.load({"masters": master_state_dict(model, masters, opt)}, checkpoint_id=path)
    fsdp.cast_master_weights_(model, masters)      # the FP8 weights from the loaded masters
"""
from __future__ import annotations

import torch

from .fsdp.modes import as_sharded, primary_shards


def master_state_dict(model: torch.nn.Module, masters: list, optimizer=None) -> dict:
    """Mode "primary": ``{name: master}`` for each FP8 weight of ``model`` (``name`` its
    parameter's name in ``model.named_parameters()``), each master -- this rank's 1-D fp32
    shard from :func:`fp8blk.torch.master_weights` -- seen as a DTensor with the weight's
    FSDP2 sharding and shape (a view: loading writes into ``masters``). With ``optimizer``
    (holding the masters), also ``{name + ".optimizer": {state name: value}}``: each state
    tensor shaped like the master as a DTensor the same way, other values (``step``) as they
    are (the same on every rank). An optimizer without state for the masters yet (a fresh one,
    to load into) gets it first from one step with learning rate 0 and zero gradients, as DCP's
    ``get_optimizer_state_dict`` does.

        sd = master_state_dict(model, masters, opt)
        torch.distributed.checkpoint.save({"masters": sd}, checkpoint_id=path)
    """
    shards = primary_shards(model, masters)
    names = {id(p): n for n, p in model.named_parameters()}
    if optimizer is not None:
        _init_state(optimizer, masters)

    def as_dtensor(t, m, param, local_shape):
        # a tensor shaped like the master, as the master: a view with the weight's sharding
        if not isinstance(t, torch.Tensor) or t.shape != m.shape:
            return t
        return as_sharded(t, param, local_shape)

    out = {}
    for (param, local_shape), m in zip(shards, masters):
        name = names.get(id(param))
        if name is None:
            raise RuntimeError("an FP8 primary weight is not a parameter of this model")
        if m.dtype != torch.float32:  # (shapes: checked by primary_shards)
            raise ValueError(f"masters: {name} needs an fp32 tensor, got {m.dtype}")
        out[name] = as_dtensor(m, m, param, local_shape)
        if optimizer is not None:
            out[name + ".optimizer"] = {k: as_dtensor(v, m, param, local_shape)
                                        for k, v in optimizer.state[m].items()}
    return out


@torch.no_grad()
def _init_state(optimizer, masters):
    """Give the masters optimizer state where they have none: one step with lr 0 on zero
    gradients (every other parameter's gradient set aside meanwhile), so that a fresh
    optimizer has state tensors for DCP to load into."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = {id(p) for p in params}
    if any(id(m) not in ids for m in masters):
        raise ValueError("the optimizer does not hold every master: pass the optimizer "
                         "built over master_weights(model)")
    missing = [m for m in masters if not optimizer.state.get(m)]
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = None
        for m in missing:
            m.grad = torch.zeros_like(m)
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        optimizer.step()
    finally:
        for p, gr in zip(params, grads):
            p.grad = gr
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr


__all__ = ["master_state_dict"]
