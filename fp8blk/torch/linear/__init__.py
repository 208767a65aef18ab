"""Float8BlockLinear: ``nn.Linear`` with its three GEMMs in block-scaled FP8 (the math, the
memory it keeps, the FSDP2 weight interface and torch.compile: docs/torch.md, "The FP8 Linear").

The room: ``module`` (the nn.Module and its DTensor weights), ``functional`` (the autograd
function, the general path, the operand choice of each GEMM), ``plans`` (the eager CUDA hot
path: one plan per call signature), ``hot`` (a layer's memo of its last plan-served call and
the lean autograd Function it runs), ``compiled`` (the plan as torch ops, for torch.compile).

The eager hot path keeps its transient FP8 copies and GEMM workspaces in one scratch
allocation per device, stream and thread, the largest call's need (fp8blk/torch/_arena.py):
:func:`scratch_bytes` says how much is held, :func:`release_scratch` frees it (the next call
allocates again).
"""
from .. import _arena
from .functional import float8_block_linear
from .module import Float8BlockLinear


def scratch_bytes() -> int:
    """Device bytes the hot path's scratch memory holds (all devices and streams)."""
    return _arena.held()


def release_scratch() -> None:
    """Free the hot path's scratch memory (e.g. before measuring memory, or between
    training and inference at other shapes)."""
    _arena.release()


__all__ = ["Float8BlockLinear", "float8_block_linear", "release_scratch", "scratch_bytes"]
