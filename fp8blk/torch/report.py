"""What ``convert_to_float8_block`` converted and what it left in high precision, and why: the
conversion report, and the rule that keeps PEFT adapters out of the conversion.

The report walks the model as it is and sorts its modules into kinds (:data:`KINDS`, first
match wins): MoE experts, MoE routers, gated MLPs, norms, linear layers. For each kind it
lists the modules fp8blk converted (qualified names) and the ones left, each with a reason:
the option that switches the kind off (``norms=False``), the converter's ``module_filter_fn``,
a PEFT adapter, or the kind's own rule (``fp8blk.torch.norm.why_not``,
``fp8blk.torch.mlp.why_not``: the same rules the swaps apply, so a reason is what the swap
found). ``convert_to_float8_block`` logs it at INFO on the logger ``fp8blk.torch.convert``,
one line per kind found in the model; :func:`conversion_report` returns the same facts as a
:class:`ConversionReport`, for a program to read without parsing logs:

    import logging
    from fp8blk.torch import conversion_report, convert_to_float8_block
    logging.basicConfig(level=logging.INFO)      # the converter's lines
    convert_to_float8_block(model, module_filter_fn=keep_head)
    report = conversion_report(model, module_filter_fn=keep_head)   # the same arguments
    report["norm"].left                           # [Left(fqn, type, reason), ...]

A line reads ``norm: 0 converted; 17 left: 17 GemmaRMSNorm ((1 + weight) form not
recognised): model.norm, model.layers.0.input_layernorm, model.layers.0.post_attention_layernorm,
...``.

A kind is one :class:`Kind` entry: a converter for another kind of module adds or replaces
its entry, with the predicate for its fp8blk module, the one for the modules it takes, the
option that switches it off and why it leaves one (the experts entry reads the mark of
``fp8blk.torch.moe.convert_experts``, which ``convert_to_float8_block(..., experts=True)``
runs).

PEFT adapters (:func:`adapter_fqns`). PEFT's tuner layers wrap a frozen ``base_layer`` and hold
the trainable adapter layers as children named by their class attribute ``adapter_layer_names``
(``BaseTunerLayer`` in ``src/peft/tuners/tuners_utils.py``; LoRA's ``LoraLayer`` in
``src/peft/tuners/lora/layer.py``: ``("lora_A", "lora_B", "lora_embedding_A",
"lora_embedding_B", "lora_magnitude_vector")``; huggingface/peft at commit
5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40). The converter leaves those children, and any module
named ``lora_A`` or ``lora_B``, with everything inside them, as they are by default
(``adapters=True`` converts them): an adapter's layers are small (rank r: FP8 saves little time
there) and are the weights being trained; the frozen base layer is converted. peft is not
imported: the rule reads attribute and child names.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

ADAPTER_NAMES = ("lora_A", "lora_B")


def adapter_fqns(model: torch.nn.Module) -> list[str]:
    """The qualified names of the modules inside `model` that are PEFT adapters (module
    docstring): children named in their parent's ``adapter_layer_names``, and modules named
    ``lora_A`` / ``lora_B``. Everything below them belongs to the adapter too."""
    out = []
    for fqn, parent in model.named_modules():
        names = getattr(type(parent), "adapter_layer_names", ())
        names = set(names) if isinstance(names, (tuple, list)) else set()
        for name, _ in parent.named_children():
            if name in names or name in ADAPTER_NAMES:
                out.append(f"{fqn}.{name}" if fqn else name)
    return out


def inside(fqn: str, prefixes: set) -> bool:
    """Whether `fqn` is one of `prefixes` (a set of qualified names) or below one: a lookup
    per level of `fqn`, not a scan of the set (a model with LoRA on every projection has
    thousands of adapters)."""
    if not prefixes:
        return False
    parts = fqn.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts) + 1))


@dataclasses.dataclass(frozen=True)
class Left:
    """A module left in high precision: its qualified name, class name and why."""
    fqn: str
    type: str
    reason: str


@dataclasses.dataclass
class KindReport:
    """One kind's part of the report: ``converted`` (qualified names of its fp8blk modules)
    and ``left`` (:class:`Left` entries)."""
    kind: str
    converted: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)

    def line(self, names: int = 3) -> str:
        """``kind: N converted; M left: <count> <type> (<reason>): <names>; ...``, naming
        at most `names` modules per (type, reason)."""
        text = f"{self.kind}: {len(self.converted)} converted; {len(self.left)} left"
        groups = {}
        for e in self.left:
            groups.setdefault((e.type, e.reason), []).append(e.fqn)
        parts = [f"{len(fqns)} {t} ({reason}): {', '.join(fqns[:names])}"
                 f"{', ...' if len(fqns) > names else ''}"
                 for (t, reason), fqns in groups.items()]
        return text + (": " + "; ".join(parts) if parts else "")


@dataclasses.dataclass
class ConversionReport:
    """What a conversion did, per kind (``report["linear"]``, ``report.kinds``: linear,
    norm, mlp, router, experts); ``lines()`` what the converter logs (the kinds found)."""
    kinds: dict

    def __getitem__(self, kind: str) -> KindReport:
        return self.kinds[kind]

    def lines(self) -> list:
        return [k.line() for k in self.kinds.values() if k.converted or k.left]

    def __str__(self):
        return "\n".join(self.lines())


@dataclasses.dataclass(frozen=True)
class Kind:
    """An entry of :data:`KINDS`. ``converted(module, name, parent)``: an fp8blk module of
    this kind; ``candidate(module, name, parent)``: a high-precision module of this kind
    (`name`: its name in `parent`); ``why_left(module)``: the kind's own reason for leaving a
    candidate; ``option``: the converter's keyword that switches the kind off, or None,
    and ``default`` its default; ``filtered``: whether ``module_filter_fn`` chooses among
    these."""
    name: str
    converted: Callable
    candidate: Callable
    why_left: Callable
    option: str = None
    filtered: bool = False
    default: bool = True


def _is_linear(module, name=None, parent=None):
    from .linear.module import Float8BlockLinear
    return isinstance(module, Float8BlockLinear)


def _linear_left(module):
    if type(module) is not torch.nn.Linear:
        return "a subclass of nn.Linear: not converted"
    return _NOT_YET


def _is_norm(module, name, parent):
    from .norm import Float8BlockRMSNorm
    return isinstance(module, Float8BlockRMSNorm)


def _norm_candidate(module, name, parent):
    return type(module).__name__.endswith("Norm") or isinstance(
        module, (torch.nn.RMSNorm, torch.nn.LayerNorm))


def _norm_left(module):
    from .norm import why_not
    return why_not(module) or _NOT_YET


def _is_mlp(module, name, parent):
    from .mlp import Float8BlockGatedMLP
    return isinstance(module, Float8BlockGatedMLP)


def _mlp_candidate(module, name, parent):
    return type(module).__name__.endswith("MLP") or isinstance(
        getattr(module, "down_proj", None), torch.nn.Module)


def _mlp_left(module):
    from .mlp import why_not
    return why_not(module) or _NOT_YET


_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj", "gate_proj")


def _holds_experts(module, name=None, parent=None):
    """Holds MoE experts' weights: 3-D parameters (experts, out, in) of its own named like a
    gated MLP's projections (transformers 5's ``MixtralExperts``, ``Qwen3MoeExperts``)."""
    return any(isinstance(p, torch.Tensor) and p.dim() == 3 and n in _EXPERT_WEIGHTS
               for n, p in module.named_parameters(recurse=False))


def _router_candidate(module, name, parent):
    """An MoE router: a class name ending in ``Router``, or a ``gate`` / ``router`` beside
    an ``experts`` child that holds experts."""
    if type(module).__name__.lower().endswith("router"):
        return True
    experts = getattr(parent, "experts", None) if parent is not None else None
    return name in ("gate", "router") and isinstance(experts, torch.nn.Module) and (
        _holds_experts(experts) or isinstance(experts, torch.nn.ModuleList))


def _experts_left(module):
    from .moe.experts import is_experts_module
    if not is_experts_module(module):
        return "not a transformers experts module (fp8blk.torch.moe.experts.is_experts_module)"
    return _NOT_YET


def _experts_converted(module, name, parent):
    # fp8blk.torch.moe.convert_experts marks the experts modules it converts with their config
    return module.__dict__.get("fp8blk_config") is not None


def _is_router(module, name, parent):
    return _is_linear(module) and _router_candidate(module, name, parent)


# a module the kind's rule takes, not converted: the report was asked before a conversion,
# or the model changed after it
_NOT_YET = "not converted yet"


# first match wins: a router that is an nn.Linear is reported as a router
KINDS = (
    Kind("experts", _experts_converted, _holds_experts,
         lambda m: _experts_left(m), option="experts", filtered=True, default=True),
    Kind("router", _is_router, _router_candidate, lambda m: "kept in high precision"),
    Kind("mlp", _is_mlp, _mlp_candidate, _mlp_left, option="gated_mlps"),
    Kind("norm", _is_norm, _norm_candidate, _norm_left, option="norms"),
    Kind("linear", _is_linear, lambda m, name, parent: isinstance(m, torch.nn.Linear),
         _linear_left, filtered=True),
)


def conversion_report(model: torch.nn.Module, module_filter_fn=None, *, adapters: bool = False,
                      kinds=KINDS, **options) -> ConversionReport:
    """What `model` holds now, per kind: its fp8blk modules and the modules left in high
    precision, with why (module docstring); the model itself is not reported (the converter
    converts inside it). Called with the arguments of the ``convert_to_float8_block`` call
    that converted `model` (``module_filter_fn``, ``adapters`` and the kinds' options:
    ``norms``, ``gated_mlps``, ``experts``; their defaults where not given; the others are
    ignored), it returns what
    that call logged; before a conversion, what there is to convert."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"conversion_report: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    skipped = set() if adapters else set(adapter_fqns(model))
    # reported in the reverse order of the matching: the most general kind (linear) first
    out = {k.name: KindReport(k.name) for k in reversed(kinds)}
    modules = []
    for fqn, parent in model.named_modules():
        for name, child in parent.named_children():
            modules.append((f"{fqn}.{name}" if fqn else name, child, name, parent))
    seen = set()
    for fqn, module, name, parent in modules:
        if id(module) in seen:        # a module held twice (tied) is reported once
            continue
        seen.add(id(module))
        for kind in kinds:
            if kind.converted(module, name, parent):
                out[kind.name].converted.append(fqn)
                break
            if not kind.candidate(module, name, parent):
                continue
            if skipped and inside(fqn, skipped):
                reason = "inside a PEFT adapter"
            elif kind.option is not None and not options.get(kind.option, kind.default):
                reason = f"{kind.option}=False"
            elif kind.filtered and module_filter_fn is not None and not module_filter_fn(
                    module, fqn):
                reason = "filtered out by module_filter_fn"
            else:
                reason = kind.why_left(module)
            out[kind.name].left.append(Left(fqn, type(module).__name__, reason))
            break
    return ConversionReport(out)


__all__ = ["ConversionReport", "KindReport", "Kind", "Left", "KINDS", "adapter_fqns",
           "conversion_report"]
