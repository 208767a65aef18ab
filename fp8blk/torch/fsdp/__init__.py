"""PyTorch FSDP2 with FP8 weights on the wire: the all-gather carries rowwise FP8 bytes, the
block scales are global, and the gathered weight equals ``fb.quantize(bf16(full weight))``
byte for byte. Two modes, "primary" (FP8 primary weights, fp32 master shards) and "cast"
(high-precision parameters); usage and design: docs/torch.md ("FSDP2 with FP8 weights").

The room: ``modes`` (``prepare_fsdp_fp8`` and each mode's per-step functions), ``registry``
(a model's converted weights, their FSDP2 objects and the batched casts), ``weights`` (the
sharded weight subclasses and what is read of FSDP2's state), ``gathered`` (the unsharded
weight FSDP2 builds after the all-gather).

    import fp8blk.torch as fbt
    from fp8blk.torch import fsdp
    from torch.distributed.fsdp import fully_shard
    fbt.convert_to_float8_block(model)
    fsdp.prepare_fsdp_fp8(model, mode="cast")
    for layer in model.layers: fully_shard(layer)
    fully_shard(model)
"""
from .modes import (MODES, cast_master_weights_, clip_master_grad_norm_, master_grads_,
                    master_weights, precompute_fp8_scales, prepare_fsdp_fp8)
from .registry import gathered_bytes

__all__ = ["prepare_fsdp_fp8", "precompute_fp8_scales", "master_weights", "master_grads_",
           "clip_master_grad_norm_", "cast_master_weights_", "gathered_bytes", "MODES"]
