"""``prepare_fsdp_fp8``: a model's FP8 linear layers' weights replaced by the FSDP2 weight
subclasses (:mod:`.weights`) of the chosen mode, and their :class:`~.registry.Registry`.
"""
from __future__ import annotations

import torch

from ...formats import Block2D, MXFP8, check_mxfp8_shape
from ...ops import quantize
from ..dtypes import HIGH_DTYPES
from ..linear import Float8BlockLinear
from ..linear.module import is_dtensor
from .models import conversions_changed
from .registry import Registry
from .weights import Float8BlockCastWeight, Float8BlockPrimaryWeight, PlaneWeight, WeightState

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
        q = quantize(local.to(model_dtype).contiguous(), recipe, rowwise=True,
                     columnwise=isinstance(recipe, MXFP8))
        state.set_scales_from(q)
        planes = [q.rowwise_data.clone()]
        if isinstance(recipe, MXFP8):
            planes.append(q.columnwise_data.clone())
        new = Float8BlockPrimaryWeight(planes, state)
    if is_dt:  # a tensor-parallel DTensor: wrap its local shard (FSDP2 + TP)
        from torch.distributed.tensor import DTensor

        new = DTensor.from_local(new, weight.device_mesh, weight.placements,
                                 shape=weight.shape, stride=weight.stride())
    return torch.nn.Parameter(new, requires_grad=weight.requires_grad)


__all__ = ["prepare_fsdp_fp8", "MODES"]
