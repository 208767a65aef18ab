"""Mixture-of-experts in block-scaled FP8 (docs/torch.md, "Experts"): ``routing`` (the padded
token layout, its permutation and combine), ``grouped`` (the experts' linear layer: per-expert
GEMMs over the padded segments), ``experts`` (transformers' experts modules: the registered
``fp8blk`` implementation and :func:`convert_experts`).
"""
from .experts import convert_experts, experts_forward
from .grouped import grouped_linear
from .routing import Routing, combine, permute, route

__all__ = ["convert_experts", "experts_forward", "grouped_linear", "Routing", "route", "permute", "combine"]
