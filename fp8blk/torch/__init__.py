"""PyTorch adapters (docs/torch.md): ``blockwise_scaled_mm``, ``Float8BlockConfig``,
``Float8BlockLinear``, ``convert_to_float8_block``, tensor/sequence-parallel styles, FSDP2
with FP8 weights and their checkpoints. Importing this package needs torch; ``import fp8blk``
does not.

Rooms: ``linear/`` (the layer, its quantize custom ops), ``fsdp/`` (FSDP2 with FP8 weights)
and ``moe/`` (mixture-of-experts: routing layout, grouped linear, transformers' experts);
beside them ``convert`` (the whole-model converter) and ``report`` (what it converted and
left), ``config`` (recipes and torch dtypes), ``scaled_mm`` and ``_cublaslt`` (the GEMM),
``tensor_parallel``, ``checkpoint``, and feature layers beside the Linear (``norm``, ``mlp``,
``recompute``).

    from fp8blk.torch import convert_to_float8_block
    convert_to_float8_block(model)
"""
try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover
    raise ImportError("fp8blk.torch needs PyTorch: pip install torch") from err

from .config import Float8BlockConfig
from .scaled_mm import blockwise_scaled_mm
from .linear import Float8BlockLinear, float8_block_linear, release_scratch, scratch_bytes
from .convert import convert_to_float8_block
from .report import ConversionReport, conversion_report
from .fsdp import (cast_master_weights_, clip_master_grad_norm_, master_grads_, master_weights,
                   precompute_fp8_scales, prepare_fsdp_fp8)
from .checkpoint import master_state_dict

__all__ = ["Float8BlockConfig", "Float8BlockLinear", "convert_to_float8_block",
           "conversion_report", "ConversionReport",
           "float8_block_linear", "blockwise_scaled_mm", "prepare_fsdp_fp8",
           "precompute_fp8_scales", "master_weights", "master_grads_", "cast_master_weights_",
           "clip_master_grad_norm_", "master_state_dict", "release_scratch", "scratch_bytes"]
