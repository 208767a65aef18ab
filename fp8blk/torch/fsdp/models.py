"""Which registries (``registry.Registry``: the converted weights of one
``prepare_fsdp_fp8`` call) a model holds: found by walking its parameters, kept per model
until the next conversion. The per-step functions of both modes start here.
"""
from __future__ import annotations

import weakref

import torch

from ..linear.module import is_dtensor
from .weights import PlaneWeight


class _ModelRegistries:
    """The registries of each model the per-step functions were called with, kept while no
    prepare_fsdp_fp8 ran since (walking every parameter of a large model each step costs
    milliseconds)."""

    def __init__(self):
        self.generation = 0
        self._known = weakref.WeakKeyDictionary()  # model -> (generation, registries)

    def of(self, model):
        hit = self._known.get(model)
        if hit is None or hit[0] != self.generation:
            hit = self._known[model] = (self.generation, _scan_registries(model))
        return hit[1]


_REGISTRIES = _ModelRegistries()


def registries_of(model):
    """The registries of the converted weights in ``model`` (a model may hold weights
    converted by several ``prepare_fsdp_fp8`` calls), kept until the next conversion."""
    return _REGISTRIES.of(model)


def conversions_changed():
    """Called by ``prepare_fsdp_fp8``: the models' registry lists may have changed."""
    _REGISTRIES.generation += 1


def _scan_registries(model):
    regs = []
    for p in model.parameters():
        local = p._local_tensor if is_dtensor(p) else p
        if isinstance(local, PlaneWeight) and local.weight_state.registry is not None:
            if all(r is not local.weight_state.registry for r in regs):
                regs.append(local.weight_state.registry)
    return regs


def gathered_bytes(model: torch.nn.Module) -> list:
    """Per converted weight, the log of its pre-all-gathers (dicts: training state, usage,
    planes sent, bytes this rank sent, world size, padded element count)."""
    return [list(s.gathers) for reg in registries_of(model) for s in reg.states]


__all__ = ["registries_of", "conversions_changed", "gathered_bytes"]
