"""Float8BlockLinear, the ``nn.Linear`` whose three GEMMs run in block-scaled FP8, and
``convert_to_float8_block``, which swaps a model's ``nn.Linear`` modules for it in place (the
math, memory and interfaces: :mod:`fp8blk.torch.linear`)."""
from __future__ import annotations

import torch

from ..config import Float8BlockConfig, config_or_default
from .dtensor import dtensor_forward, is_dtensor
from .functional import check_features, float8_block_linear


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
        if torch.compiler.is_compiling() and (self._fp8blk_tp is not None
                                              or _fsdp_fp8_weight(self.weight)):
            return _forward_eagerly(self, x)
        return self._forward(x)

    def _forward(self, x):
        if self._fp8blk_tp is not None:
            return self._fp8blk_tp.forward(self, x)
        if is_dtensor(self.weight):
            return dtensor_forward(self, x)
        return float8_block_linear(x, self.weight, self.bias, self.config,
                                   keep_input=self._keep_input)

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


def convert_to_float8_block(model: torch.nn.Module, config: Float8BlockConfig = None,
                            module_filter_fn=None, *, share_quantize: bool = False,
                            norms: bool = False, gated_mlps: bool = False,
                            keep_inputs: bool = False) -> torch.nn.Module:
    """Swap every ``nn.Linear`` inside ``model`` for a Float8BlockLinear sharing its
    parameters, in place, and return ``model``. ``module_filter_fn(module, fqn) -> bool``
    chooses which (default: all). A layer the recipe cannot take (MXFP8: features not
    multiples of 32) raises a ValueError naming it; filter it out to keep it in bf16.
    ``share_quantize``: layers reading the same tensor share its FP8 copies within each
    forward call of ``model`` (``fp8blk.torch.linear.sharing``). ``norms``: RMSNorms swapped
    for ones keeping only their input between the passes (``fp8blk.torch.norm``).
    ``gated_mlps``: SwiGLU MLPs swapped for ones not keeping the activation's output
    (``fp8blk.torch.mlp``). Both keep the state dict and give the same bytes, but for the
    norms' input gradients (within a rounding bound: ``fp8blk.torch.norm``).
    ``keep_inputs``: layers keep their input instead of its FP8 copy where it is kept anyway
    (``Float8BlockLinear.keep_input``; the same bytes): attention output projections (an
    ``o_proj`` beside a ``q_proj`` or ``qkv_proj``, as in Hugging Face's Llama, Mistral, Qwen
    and Phi-3: its input is what scaled_dot_product_attention keeps for its own backward
    pass) and the down projections of the swapped gated MLPs (their input kept as its formula
    of the gate and up outputs, ``fp8blk.torch.mlp``).

    A model converted before may be converted again with the same config (its
    Float8BlockLinears are kept); a Float8BlockLinear with another config raises a ValueError
    naming it (a layer's config is fixed once it is built: its plans, FSDP2 weight and
    sequence-parallel style follow it), unless ``module_filter_fn`` leaves it out."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_to_float8_block: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    config = config_or_default(config, "convert_to_float8_block")

    def swap(module, fqn):
        linear = type(module) is torch.nn.Linear
        if (linear or isinstance(module, Float8BlockLinear)) and (
                module_filter_fn is None or module_filter_fn(module, fqn)):
            if linear:
                try:
                    return Float8BlockLinear.from_linear(module, config)
                except ValueError as err:
                    raise ValueError(f"convert_to_float8_block: layer {fqn!r}: {err}") from None
            if module.config == config:
                return module
            raise ValueError(f"convert_to_float8_block: layer {fqn!r} is a Float8BlockLinear "
                             f"with config {module.config!r} already, this call's config is "
                             f"{config!r}; convert once, or leave the layer out with "
                             f"module_filter_fn")
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
    if norms:
        from ..norm import convert_norms
        convert_norms(model)
    if gated_mlps:
        from ..mlp import convert_gated_mlps
        convert_gated_mlps(model)
    if keep_inputs:
        _set_keep_inputs(model, module_filter_fn)
    if share_quantize:
        from .sharing import install
        install(model)
    return model


def _set_keep_inputs(model, module_filter_fn):
    from ..mlp import Float8BlockGatedMLP
    for fqn, parent in model.named_modules():
        names = dict(parent.named_children())
        attention = "o_proj" in names and ("q_proj" in names or "qkv_proj" in names)
        for name, child in names.items():
            full = f"{fqn}.{name}" if fqn else name
            if not isinstance(child, Float8BlockLinear) or (
                    module_filter_fn is not None and not module_filter_fn(child, full)):
                continue
            if (attention and name == "o_proj") or (
                    isinstance(parent, Float8BlockGatedMLP) and name == "down_proj"):
                child.keep_input = True


__all__ = ["Float8BlockLinear", "convert_to_float8_block"]
