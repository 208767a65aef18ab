"""Float8BlockLinear: ``nn.Linear`` with its three GEMMs in block-scaled FP8 (the math, the
memory it keeps, the FSDP2 weight interface and torch.compile: docs/torch.md, "The FP8 Linear").

The room: ``module`` (the nn.Module and its DTensor weights), ``functional`` (the autograd
function, the general path, the operand choice of each GEMM), ``plans`` (the eager CUDA hot
path: one plan per call signature), ``compiled`` (the plan as torch ops, for torch.compile).
"""
from .functional import float8_block_linear
from .module import Float8BlockLinear

__all__ = ["Float8BlockLinear", "float8_block_linear"]
