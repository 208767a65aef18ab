"""The two ways to own the weights: :func:`prepare_fsdp_fp8` converts a model's FP8 linear
weights to the FSDP2 weight subclasses of mode "primary" (FP8 primary weights, fp32 master
shards: :func:`master_weights`, :func:`master_grads_`, :func:`clip_master_grad_norm_`,
:func:`cast_master_weights_`) or mode "cast" (high-precision parameters, FP8 on the wire:
:func:`precompute_fp8_scales`). docs/torch.md has the usage."""
from __future__ import annotations

import functools

import torch

from ...formats import Block2D, MXFP8, check_mxfp8_shape
from ...ops import quantize_buffers
from ..config import HIGH_DTYPES
from ..linear import Float8BlockLinear
from ..linear.module import is_dtensor
from .registry import Registry, cast_all, cast_item, conversions_changed, recast, registries_of
from .weights import (Float8BlockCastWeight, Float8BlockPrimaryWeight, PlaneWeight, WeightState,
                      local_of)


# --------------------------------------------------------------------------------------------
# Conversion


MODES = ("primary", "cast")


def prepare_fsdp_fp8(model: torch.nn.Module, mode: str = "cast", module_filter_fn=None,
                     recipe=None, model_dtype=torch.bfloat16) -> torch.nn.Module:
    """Make the weights of ``model``'s FP8 linear layers gather as FP8 under FSDP2; in place,
    before ``fully_shard``. Returns ``model``.

    ``mode``: "cast" (high-precision parameters, FP8 on the wire) or "primary" (FP8 primary
    weights updated from fp32 masters). ``module_filter_fn(module, fqn) -> bool`` picks the
    modules whose ``weight`` (2-D) is converted (default: every Float8BlockLinear). ``recipe``:
    the weights' recipe (default: the module's ``config.weight``, else ``fb.Block2D()``);
    Block2D or MXFP8 (both dims multiples of 32). ``model_dtype``: the dtype the FP8 bytes are
    quantized from (bf16: the gathered weight is ``quantize(bf16(w))``); float32, bfloat16
    or float16.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if model_dtype not in HIGH_DTYPES:
        raise TypeError(f"model_dtype must be torch.float32, bfloat16 or float16, got "
                        f"{model_dtype}")
    if module_filter_fn is None:
        def module_filter_fn(module, fqn):
            return isinstance(module, Float8BlockLinear)
    if any(hasattr(m, "_get_fsdp_state") for m in model.modules()):
        raise ValueError("prepare_fsdp_fp8 must run before fully_shard (it replaces the "
                         "weights FSDP2 would shard)")
    registry = Registry(model)
    conversions_changed()
    for fqn, module in model.named_modules():
        if not module_filter_fn(module, fqn):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{fqn or 'model'}: prepare_fsdp_fp8 needs a 2-D `weight` "
                             f"parameter, got {None if weight is None else tuple(weight.shape)}")
        if isinstance(weight, PlaneWeight) or is_dtensor(weight) and \
                isinstance(weight._local_tensor, PlaneWeight):
            raise ValueError(f"{fqn or 'model'}.weight is already converted")
        r = recipe if recipe is not None else getattr(getattr(module, "config", None),
                                                      "weight", Block2D())
        module.weight = _convert(weight, r, mode, model_dtype, fqn)
        registry.states.append(module.weight.weight_state if not is_dtensor(module.weight)
                               else module.weight._local_tensor.weight_state)
        registry.states[-1].registry = registry
    return model


def _convert(weight, recipe, mode, model_dtype, fqn):
    if not isinstance(recipe, (Block2D, MXFP8)):
        raise TypeError(f"{fqn}: FSDP FP8 weights are Block2D or MXFP8, got {recipe!r}")
    is_dt = is_dtensor(weight)
    local = weight._local_tensor if is_dt else weight
    local = local.detach()
    rows, cols = local.shape
    check_mxfp8_shape(recipe, rows, cols, f"the weight {fqn}")
    if local.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{fqn}: the weight must be float32 or bfloat16 (it is the master "
                        f"for the FP8 cast), got {local.dtype}")
    if local.is_meta and mode == "primary":
        raise ValueError(f"{fqn}: mode 'primary' quantizes the weight when converting it, so it "
                         f"needs the weight's values: initialize the model on a device before "
                         f"prepare_fsdp_fp8, or use mode='cast' (which supports a meta-device "
                         f"init followed by model.to_empty)")
    state = WeightState(recipe, (rows, cols), local.dtype, model_dtype, mode, local.device)
    if mode == "cast":
        new = Float8BlockCastWeight([local.contiguous()], state)
    else:
        rd, rs, cd, cs = quantize_buffers(local.to(model_dtype).contiguous(), recipe,
                                          rowwise=True, columnwise=isinstance(recipe, MXFP8))
        state.set_scales(rs, cs)
        planes = [rd.clone()]
        if isinstance(recipe, MXFP8):
            planes.append(cd.clone())
        new = Float8BlockPrimaryWeight(planes, state)
    if is_dt:  # a tensor-parallel DTensor: wrap its local shard (FSDP2 + TP)
        from torch.distributed.tensor import DTensor

        new = DTensor.from_local(new, weight.device_mesh, weight.placements,
                                 shape=weight.shape, stride=weight.stride())
    return torch.nn.Parameter(new, requires_grad=weight.requires_grad)


def precompute_fp8_scales(model: torch.nn.Module) -> None:
    """Mode "cast": global tile scales of every converted weight of ``model`` from ONE packed
    partial-amax all-reduce (per recipe), and each rank's rows cast to FP8 with them, ready
    for the next all-gathers. Call after ``optimizer.step()`` on every rank (else it happens
    lazily at the first gather after the parameters changed)."""
    for reg in registries_of(model):
        recast(reg)


# --------------------------------------------------------------------------------------------
# Mode "primary": the master shards and their cast


def _primary_entries(model):
    out = []
    for reg in registries_of(model):
        out += [(reg, entry) for entry in reg.entries("primary")]
    return out


def master_weights(model: torch.nn.Module) -> list:
    """Mode "primary": fp32 master shards, one per FP8 weight of ``model`` (in a fixed order):
    the flat elements [o, o+n) of the row-major weight that FSDP2 gave this rank (the rows it
    holds), as 1-D fp32 leaf tensors with ``requires_grad=True``, initialized to the FP8
    weight's values (dequantized). Pass them to the optimizer."""
    out = []
    for reg, (state, fp, *_) in _primary_entries(model):
        vals = reg.local_values(state, local_of(fp).planes[0])
        out.append(vals.reshape(-1).float().clone().requires_grad_(True))
    return out


def primary_shards(model: torch.nn.Module, masters: list) -> list:
    """Internal door (fp8blk.torch.checkpoint): per FP8 primary weight of ``model``, in
    :func:`master_weights`' order, the sharded parameter FSDP2 registered on the module (a
    DTensor) and its local shape, once ``masters`` is checked to be one 1-D shard per
    weight (ValueError otherwise)."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    return [(fp.sharded_param, tuple(local_of(fp).shape)) for reg, (state, fp, *_) in entries]


def as_sharded(t, param, local_shape):
    """Internal door: `t`, this rank's flat shard of a weight (a master, its gradient or an
    optimizer state of it), seen as a DTensor with the weight's FSDP2 sharding and shape (a
    view: writes reach `t`)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.detach().view(local_shape), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)


def clip_master_grad_norm_(model: torch.nn.Module, masters: list, max_norm: float,
                           norm_type: float = 2.0, other_parameters=(),
                           error_if_nonfinite: bool = False) -> torch.Tensor:
    """Mode "primary": ``torch.nn.utils.clip_grad_norm_`` over the masters' gradients (after
    :func:`master_grads_`) and the gradients of ``other_parameters`` (the model's other
    parameters the optimizer updates, e.g. norms and embeddings under FSDP2). The norm is the
    one of the whole weights: each master's gradient is seen as a DTensor with its weight's
    FSDP2 sharding, so every rank gets the same norm and scales by the same factor.
    (``torch.nn.utils.clip_grad_norm_(masters, ...)`` would see plain tensors and use each
    rank's own shard: a different factor per rank.) Returns the total norm, a plain tensor,
    equal on every rank.

        fsdp.master_grads_(model, masters)
        fsdp.clip_master_grad_norm_(model, masters, 1.0, other_parameters=others)
        opt.step()
    """
    from torch.distributed.tensor import DTensor

    shards = primary_shards(model, masters)
    sharded = [as_sharded(m.grad, p, shape) for (p, shape), m in zip(shards, masters)
               if m.grad is not None]
    others = [p.grad for p in other_parameters if p.grad is not None]
    dist_grads = sharded + [g for g in others if isinstance(g, DTensor)]
    plain = [g for g in others if not isinstance(g, DTensor)]
    norms = []
    for group in (dist_grads, plain):
        if group:
            n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.tensor(0.0)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
        torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # the scaling is elementwise: each rank scales its own shards (torch's clip_grads_with_norm_
    # formula)
    local = [m.grad for m in masters if m.grad is not None] + \
        [g.to_local() if isinstance(g, DTensor) else g for g in others]
    by_device = {}
    for g in local:
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total


def master_grads_(model: torch.nn.Module, masters: list) -> None:
    """Mode "primary": ``master.grad`` = this rank's sharded gradient of each FP8 weight, as
    fp32 (FSDP2 reduce-scatters the weights' gradients as usual), and the weight's own
    ``.grad`` cleared (the gradient moves: the next backward starts from none, as
    ``optimizer.zero_grad`` does for the masters). Call after backward."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    dst, src = [], []
    for (reg, (state, fp, *_)), m in zip(entries, masters):
        param = fp.sharded_param
        g = param.grad
        if g is None:
            m.grad = None
            continue
        g = (g._local_tensor if is_dtensor(g) else g).reshape(-1)
        param.grad = None
        if g.dtype == torch.float32:  # the gradient itself becomes the master's
            m.grad = g
            continue
        m.grad = torch.empty(g.numel(), dtype=torch.float32, device=g.device)
        dst.append(m.grad)
        src.append(g)
    if dst:
        # one multi-tensor copy: faster than one tensor.to(float32) call per weight
        torch._foreach_copy_(dst, src)


def _check_masters(entries, masters):
    if not isinstance(masters, (list, tuple)) or len(masters) != len(entries):
        raise ValueError(f"masters must be the list from master_weights(model) ({len(entries)} "
                         f"tensors), got {type(masters).__name__} of "
                         f"{len(masters) if hasattr(masters, '__len__') else '?'}")
    for i, ((reg, (state, fp, start, count, chunk)), m) in enumerate(zip(entries, masters)):
        if not isinstance(m, torch.Tensor) or m.dim() != 1 or m.numel() != count:
            raise ValueError(f"masters[{i}]: expected a 1-D tensor of {count} elements (this rank's "
                             f"shard of a {state.shape} weight), got "
                             f"{getattr(m, 'shape', type(m).__name__)}")


@torch.no_grad()
def cast_master_weights_(model: torch.nn.Module, masters: list) -> None:
    """Mode "primary": write every FP8 weight of ``model`` from its fp32 master shard with ONE
    all-reduce per recipe for all weights (``fb.cast_master_weights``' batched cast over a
    TorchComm of the FSDP mesh, without its rank-agreement header -- FSDP2 gives every rank
    the same weights and shards -- so the host never waits for the GPU): each rank writes the
    bytes of its own rows, every rank the global scales. After the all-gather, each weight
    equals ``quantize(bf16(full master))`` byte for byte."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    by_reg = {}
    for (reg, entry), m in zip(entries, masters):
        by_reg.setdefault(id(reg), (reg, [], []))
        by_reg[id(reg)][1].append(entry)
        by_reg[id(reg)][2].append(m)
    for reg, ents, ms in by_reg.values():
        cast_all(reg, ents, functools.partial(_primary_item, ms))


def _primary_item(masters, j, i, entry):
    """The Item of a mode "primary" weight: master `masters[i]`, bytes into the local planes."""
    m = masters[i]
    planes = local_of(entry[1]).planes
    key = (m.data_ptr(), m.dtype, planes[0].data_ptr(), planes[-1].data_ptr(),
           planes[0].numel())
    return cast_item(j, entry, key, _primary_sources, m)


def _primary_sources(entry, m):
    planes = local_of(entry[1]).planes
    return m, planes[0].reshape(-1), planes[1].reshape(-1) if len(planes) > 1 else None


__all__ = ["MODES", "prepare_fsdp_fp8", "precompute_fp8_scales", "master_weights",
           "master_grads_", "clip_master_grad_norm_", "cast_master_weights_", "primary_shards",
           "as_sharded"]
