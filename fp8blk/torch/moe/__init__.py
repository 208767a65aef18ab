"""Mixture-of-experts in block-scaled FP8 (docs/torch.md, "Experts"): ``routing`` (the padded
token layout, its permutation and combine), ``gemms`` (the per-expert GEMMs over the padded
segments and the experts' FP8 weights), ``grouped`` (the experts' linear layer on them),
``experts`` (transformers' experts modules: the registered ``fp8blk`` implementation and
:func:`convert_experts`), ``parallel`` (expert parallelism: :func:`expert_parallel`, the FP8
dispatch and the combine over a communicator).
"""
from .experts import convert_experts, experts_forward
from .grouped import grouped_linear, permute_grouped_linear
from .parallel import expert_parallel
from .routing import Routing, combine, permute, route

__all__ = ["convert_experts", "experts_forward", "expert_parallel", "grouped_linear",
           "permute_grouped_linear", "Routing", "route", "permute", "combine"]
