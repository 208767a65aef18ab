"""``convert_to_float8_block``: swaps a model's ``nn.Linear`` modules for Float8BlockLinear in
place, with its RMSNorms, SwiGLU MLPs and shared quantizes (the Hugging Face name rules for
``keep_inputs``), and logs what it converted and what it left (``fp8blk.torch.report``).
docs/torch.md has the options, what each costs and saves."""
from __future__ import annotations

import logging

import torch

from .config import Float8BlockConfig, config_or_default
from .linear.module import Float8BlockLinear
from .report import adapter_fqns, conversion_report, inside

logger = logging.getLogger(__name__)


def convert_to_float8_block(model: torch.nn.Module, config: Float8BlockConfig = None,
                            module_filter_fn=None, *, share_quantize: bool = True,
                            norms: bool = True, gated_mlps: bool = True,
                            keep_inputs: bool = True, adapters: bool = False,
                            experts: bool = True) -> torch.nn.Module:
    """Swap every ``nn.Linear`` inside ``model`` for a Float8BlockLinear sharing its
    parameters, in place, and return ``model``; by default also the memory-saving parts
    below, each switched off by its keyword (``norms=False``; all four False: the Linear swap
    alone). ``module_filter_fn(module, fqn) -> bool`` chooses which linear layers (default:
    all). A layer the recipe cannot take (MXFP8: features not multiples of 32) raises a
    ValueError naming it; filter it out to keep it in bf16.

    ``share_quantize``: layers reading the same tensor share its FP8 copies within each
    forward call of ``model`` (``fp8blk.torch.linear.sharing``; the same bytes). ``norms``:
    RMSNorms swapped for ones keeping only their input between the passes
    (``fp8blk.torch.norm``). ``gated_mlps``: SwiGLU MLPs swapped for ones not keeping the
    activation's output (``fp8blk.torch.mlp``). Both keep the state dict and give the same
    bytes, but for the norms' input gradients (within a rounding bound: ``fp8blk.torch.norm``).
    ``keep_inputs``: layers keep their input instead of its FP8 copy where it is kept anyway
    (``Float8BlockLinear.keep_input``; the same bytes): attention output projections (an
    ``o_proj`` beside a ``q_proj`` or ``qkv_proj``, as in Hugging Face's Llama, Mistral, Qwen
    and Phi-3: its input is what scaled_dot_product_attention keeps for its own backward
    pass), the down projections of the swapped gated MLPs (their input kept as its formula
    of the gate and up outputs, ``fp8blk.torch.mlp``) and the experts' first projections
    (the tokens, which the router keeps, instead of their permuted copies:
    ``fp8blk.torch.moe.convert_experts``). ``adapters``: PEFT adapters' layers
    (``lora_A``, ``lora_B``, the children a module names in ``adapter_layer_names``) are left
    as they are unless True; their frozen base layers are converted (``fp8blk.torch.report``).
    ``experts``: transformers' mixture-of-experts experts modules (3-D expert weights) run
    their GEMMs in block-scaled FP8 (``fp8blk.torch.moe.convert_experts``, chosen by
    ``module_filter_fn`` too; docs/torch.md, "Mixture of experts"). Routers stay in high
    precision either way.

    What was converted and what was left, and why, is logged at INFO on the logger
    ``fp8blk.torch.convert``, one line per kind of module found (linear, norm, mlp, experts,
    router); ``fp8blk.torch.conversion_report(model, ...)`` with this call's arguments returns
    it as data.

    On the meta device the norms and MLPs are swapped as on a real device: the byte-equality
    probe that decides a swap runs on a CPU copy of the module with random values
    (``fp8blk.torch.recompute.probe_twin``) instead of lazily on the first forward call, so
    the converted model has its final module types at once, before ``model.to_empty(...)``
    and FSDP2's ``fully_shard`` (which must see the modules it wraps), and the new modules hold
    the old ones' parameters, which ``to_empty`` and the model's init reach as before (HF's
    ``_init_weights`` takes Float8BlockLinear as an ``nn.Linear`` and Float8BlockRMSNorm by
    its name).

    A model converted before may be converted again with the same config (its
    Float8BlockLinears are kept); a Float8BlockLinear with another config raises a ValueError
    naming it (a layer's config is fixed once it is built: its plans, FSDP2 weight and
    sequence-parallel style follow it), unless ``module_filter_fn`` leaves it out."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_to_float8_block: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    config = config_or_default(config, "convert_to_float8_block")
    skipped = set() if adapters else set(adapter_fqns(model))

    def swap(module, fqn):
        if fqn in skipped:
            return module
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
    # norms and MLPs: every one the rules take but those inside adapters (the filter chooses
    # among linear layers only: it may read their attributes)
    outside = None if not skipped else (lambda m, fqn: not inside(fqn, skipped))
    if norms:
        from .norm import convert_norms
        convert_norms(model, outside)
    if gated_mlps:
        from .mlp import convert_gated_mlps
        convert_gated_mlps(model, outside)
    if experts:
        from .moe.experts import convert_experts
        convert_experts(model, config, None if not (module_filter_fn or skipped) else
                        lambda m, fqn: not inside(fqn, skipped) and (
                            module_filter_fn is None or module_filter_fn(m, fqn)),
                        keep_input=keep_inputs)
    if keep_inputs:
        _set_keep_inputs(model, module_filter_fn, skipped)
    if share_quantize:
        from .linear.sharing import install
        install(model)
    if logger.isEnabledFor(logging.INFO):
        report = conversion_report(model, module_filter_fn, norms=norms, gated_mlps=gated_mlps,
                                   adapters=adapters, experts=experts)
        for line in report.lines():
            logger.info("convert_to_float8_block: %s", line)
    return model


def _set_keep_inputs(model, module_filter_fn, skipped):
    from .mlp import Float8BlockGatedMLP
    for fqn, parent in model.named_modules():
        names = dict(parent.named_children())
        attention = "o_proj" in names and ("q_proj" in names or "qkv_proj" in names)
        for name, child in names.items():
            full = f"{fqn}.{name}" if fqn else name
            if not isinstance(child, Float8BlockLinear) or inside(full, skipped) or (
                    module_filter_fn is not None and not module_filter_fn(child, full)):
                continue
            if (attention and name == "o_proj") or (
                    isinstance(parent, Float8BlockGatedMLP) and name == "down_proj"):
                child.keep_input = True


__all__ = ["convert_to_float8_block"]
