"""transformers' experts modules in block-scaled FP8: the ``fp8blk`` implementation registered
with ``transformers.integrations.moe.ExpertsInterface`` and :func:`convert_experts`
(docs/torch.md, "Experts").

transformers 5.x keeps a MoE layer's experts as 3-D parameters (``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I), or transposed) in a module whose class is decorated with
``use_experts_implementation``: its forward looks up ``config._experts_implementation`` in
the interface on every call. Registering an implementation there keeps the module, its
parameters, its state dict and checkpoint keys, its activation and gating (``_apply_gate``,
``act_fn``) and its flags (``has_gate``, ``has_bias``, ``is_transposed``); the converter
marks the modules it converts (their ``fp8blk_config`` attribute) and sets the
implementation on their config. A module sharing that config but left out by the filter
runs the implementation the config had before. Under torch.compile a converted experts module
traces without graph breaks (the per-expert GEMM loops are custom ops:
``fp8blk.torch.moe.gemms``); what it keeps between the passes is ``grouped.COMPILED_RECOMPUTE``'s
choice.

Per call: the routing's padded layout (``routing``), the tokens permuted into it, the gate/up
projection and the down projection as :func:`~fp8blk.torch.moe.grouped.grouped_linear`, the
model's own gating between them (transformers' default SiLU gating as
``fp8blk.torch.mlp.silu_gate``: the same bytes, SiLU's output not kept), and the combine weighted by the router's ``top_k_weights``
(autograd reaches the router through them). The router stays in high precision.

    import torch, transformers
    from fp8blk.torch.moe.experts import convert_experts
    cfg = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=128)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    convert_experts(model)                       # 1 experts module converted
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..config import Float8BlockConfig, config_or_default
from ..mlp import is_silu, silu_gate
from . import grouped
from .grouped import (check_experts_config, grouped_linear, grouped_linear_combine,
                      permute_grouped_linear)
from .routing import combine, permute, route

NAME = "fp8blk"


def _interface():
    from transformers.integrations import moe
    return moe.ALL_EXPERTS_FUNCTIONS


def _original_forward(module):
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def _fallback(module, *args):
    name = module.__dict__.get("fp8blk_fallback") or "grouped_mm"
    fn = _interface().get_interface(name, _original_forward(module))
    return fn(module, *args)


def expert_bias(module, name):
    """The bias (E, N) of the module's projection ``name`` ("gate_up_proj", "up_proj",
    "down_proj"), or None for a module without biases."""
    return getattr(module, f"{name}_bias") if module.has_bias else None


def _project(x, module, name, routing, cfg):
    return grouped_linear(x, getattr(module, name), routing, cfg,
                          bias=expert_bias(module, name), transposed=module.is_transposed)


def _silu_gated(module) -> bool:
    """transformers' default gating (``gate, up = h.chunk(2, -1); act_fn(gate) * up``) with
    SiLU: run as ``fp8blk.torch.mlp.silu_gate``, which keeps h alone for the backward pass
    (not SiLU's output as well), with autograd's bytes."""
    from transformers.integrations import moe as hf_moe
    if not module.has_gate or getattr(type(module)._apply_gate, "__code__", None) is not \
            hf_moe._default_apply_gate.__code__:
        return False
    first = module.gate_up_proj
    dtype = first.dtype if first.dtype.is_floating_point else torch.float32
    return is_silu(module.act_fn, torch.randn(4, 8, dtype=dtype))


def _keeps_zero(module) -> bool:
    """Whether the module's gating (or activation) maps a zero row to a zero row (SiLU, GELU,
    ReLU, gpt-oss's clamped gate do): probed at conversion on a CPU row of zeros."""
    first = module.gate_up_proj if module.has_gate else module.up_proj
    width = first.shape[2] if module.is_transposed else first.shape[1]
    with torch.no_grad():
        zero = torch.zeros((1, width))
        out = module._apply_gate(zero) if module.has_gate else module.act_fn(zero)
    return bool((out == 0).all())


def _keeps_tokens(module, hidden, routing) -> bool:
    """Whether the first projection keeps the tokens (T, H) for its weight gradient instead
    of the permuted rows' columnwise FP8 copy (``grouped.permute_grouped_linear``): where the
    converter's ``keep_inputs`` asked for it and the tokens take no more bytes than that copy
    (top-k >= 2 in bf16; the router, reading the same tokens, keeps them anyway)."""
    return (module.__dict__.get("fp8blk_keep_input", False)
            and hidden.element_size() * routing.tokens <= routing.rows)


def gate(module, h: torch.Tensor, routing) -> torch.Tensor:
    """The module's gating (or activation) of the first projection's output ``h`` (rows, 2I
    or I) in the padded layout: transformers' default SiLU gating as ``silu_gate``, else the
    module's own ``_apply_gate`` / ``act_fn``; padding rows re-zeroed where the gating does
    not keep zeros (``fp8blk_zero_rows``)."""
    if module.fp8blk_silu_gate:
        h = silu_gate(*h.chunk(2, dim=-1))
    else:
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    if not module.fp8blk_zero_rows:
        # padding rows must stay zero: every 128x1 block of the next quantize then holds one
        # expert's rows alone
        h = h * routing.valid_rows().unsqueeze(-1).to(h.dtype)
    return h


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``fp8blk`` experts implementation: ``hidden_states`` (T, H), ``top_k_index`` (T, k)
    expert ids, ``top_k_weights`` (T, k) -> (T, H) in hidden_states' dtype. A module without
    ``fp8blk_config`` (left out by the converter's filter) runs its config's previous
    implementation."""
    cfg = module.__dict__.get("fp8blk_config")
    if cfg is None:
        return _fallback(module, hidden_states, top_k_index, top_k_weights)
    parallel = module.__dict__.get("fp8blk_ep")
    if parallel is not None:
        return parallel.forward(module, hidden_states, top_k_index, top_k_weights)
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError(
            "fp8blk experts do not run under transformers' expert parallelism; leave these "
            "experts out of convert_experts (module_filter_fn) or use another "
            "experts_implementation")
    routing = route(top_k_index, module.num_experts)
    if routing.rows == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    first = "gate_up_proj" if module.has_gate else "up_proj"
    if _keeps_tokens(module, hidden_states, routing):
        h = permute_grouped_linear(hidden_states, getattr(module, first), routing, cfg,
                                   bias=expert_bias(module, first),
                                   transposed=module.is_transposed)
    else:
        h = _project(permute(hidden_states, routing), module, first, routing, cfg)
    if torch.compiler.is_compiling():
        # compiled, the rest runs as separate nodes (the fused node traced through would keep
        # no less: its recomputation reads saved tensors alone, so the partitioner moves it
        # into the forward pass); with COMPILED_RECOMPUTE in a checkpointed region, which the
        # partitioner makes again in the backward pass: h kept, as eager mode keeps it
        if grouped.COMPILED_RECOMPUTE:
            return checkpoint(_after_first, module, h, routing, top_k_weights, cfg,
                              hidden_states.dtype, use_reentrant=False)
        return _after_first(module, h, routing, top_k_weights, cfg, hidden_states.dtype)
    if getattr(module, "has_post_expert_norm", False):
        # a norm between the down projection and the combine keeps the nodes apart
        return _after_first(module, h, routing, top_k_weights, cfg, hidden_states.dtype)
    # the down projection and the combine as one node; with SiLU gating the gating runs
    # inside it too: h kept, the gated rows made again in the backward pass
    silu = module.fp8blk_silu_gate
    return grouped_linear_combine(h if silu else gate(module, h, routing), module.down_proj,
                                  routing, top_k_weights, hidden_states.dtype, cfg,
                                  bias=expert_bias(module, "down_proj"),
                                  transposed=module.is_transposed, silu_gated=silu)


def _after_first(module, h, routing, top_k_weights, cfg, dtype):
    """The experts after their first projection as separate nodes: the gating, the down
    projection, the module's post-expert norm where it has one, the combine; (T, H) in
    ``dtype``."""
    y = _project(gate(module, h, routing), module, "down_proj", routing, cfg)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return combine(y, routing, top_k_weights, dtype)


def register():
    """Register :func:`experts_forward` as ``"fp8blk"`` with transformers' ExpertsInterface
    (idempotent; :func:`convert_experts` calls it)."""
    interface = _interface()
    if NAME not in interface:
        type(interface).register(NAME, experts_forward)


def is_experts_module(module: torch.nn.Module) -> bool:
    """A transformers experts module (``use_experts_implementation``'s flags and 3-D
    projection parameters)."""
    if not all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed",
                                            "num_experts", "config")):
        return False
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(first, torch.Tensor) and first.dim() == 3 and
            isinstance(down, torch.Tensor) and down.dim() == 3)


def convert_experts(model: torch.nn.Module, config: Float8BlockConfig = None,
                    module_filter_fn=None, *, keep_input: bool = False) -> list:
    """Run every transformers experts module inside ``model`` (:func:`is_experts_module`)
    through fp8blk's grouped FP8 GEMMs, in place; ``module_filter_fn(module, fqn) -> bool``
    chooses which. Parameters and state dict are unchanged. Returns the converted modules'
    names. A module converted before with another config raises a ValueError naming it.
    ``keep_input``: the first projection keeps the tokens instead of the permuted rows'
    columnwise FP8 copy where they take no more bytes (the same bytes out;
    ``grouped.permute_grouped_linear``); ``convert_to_float8_block``'s ``keep_inputs`` sets
    it."""
    config = config_or_default(config, "convert_experts")
    found = [(fqn, m) for fqn, m in model.named_modules() if is_experts_module(m)]
    if not found:
        return []
    check_experts_config(config, "convert_experts")
    register()
    converted, configs = [], {}
    for fqn, m in found:
        configs.setdefault(id(m.config), (m.config, []))[1].append(m)
        if module_filter_fn is not None and not module_filter_fn(m, fqn):
            continue
        old = m.__dict__.get("fp8blk_config")
        if old is not None and old != config:
            raise ValueError(f"convert_experts: {fqn!r} runs fp8blk experts with config "
                             f"{old!r} already, this call's config is {config!r}")
        m.fp8blk_config = config
        m.fp8blk_zero_rows = _keeps_zero(m)
        m.fp8blk_silu_gate = _silu_gated(m)
        m.fp8blk_keep_input = bool(keep_input)
        converted.append(fqn)
    for hf_config, modules in configs.values():
        previous = hf_config._experts_implementation
        if previous != NAME:
            for m in modules:
                m.fp8blk_fallback = previous
            hf_config._experts_implementation = NAME
    return converted


__all__ = ["experts_forward", "gate", "expert_bias", "register", "is_experts_module",
           "convert_experts", "NAME"]
