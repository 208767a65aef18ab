"""PyTorch FSDP2 with FP8 weights on the wire (docs/distributed.md, docs/torch.md).

With bf16 parameters FSDP2 all-gathers 2 bytes per weight element in every forward and again
in every backward. Here the all-gather carries the rowwise FP8 bytes only (1 byte per element;
no scales, no columnwise copy), the columnwise copy is the local FP8 transpose, and the block
scales are *global* (partial amax of each rank's shard, one packed MAX all-reduce for all
weights), so FSDP's shard boundaries may cut 128x128 tiles anywhere (TE's FSDP2 path needs
them on tile rows) and the gathered weight equals ``fb.quantize(bf16(full weight))`` byte for
byte.

Two ways to own the weights (convert with :func:`prepare_fsdp_fp8` after
``convert_to_float8_block`` and before ``fully_shard``):

* ``mode="primary"`` (TransformerEngine's FP8 primary weights): the model's weights ARE FP8
   (:class:`~fp8blk.torch.fsdp.weights.Float8BlockPrimaryWeight`); the optimizer updates fp32
   master shards, the flat range FSDP2 assigns to the rank::

       masters = fsdp.master_weights(model)          # fp32 leaves, one per FP8 weight
       opt = torch.optim.AdamW(masters + other_params)
       loss.backward(); fsdp.master_grads_(model, masters)
       fsdp.clip_master_grad_norm_(model, masters, 1.0, other_parameters=other_params)
       opt.step()
       fsdp.cast_master_weights_(model, masters)      # one all-reduce per recipe, all weights

   Checkpoints: :mod:`fp8blk.torch.checkpoint` (``master_state_dict``).

* ``mode="cast"`` (torchao's float8-FSDP pattern): parameters stay bf16/fp32, wrapped in
   :class:`~fp8blk.torch.fsdp.weights.Float8BlockCastWeight`; the optimizer updates them as usual.
   Once per step (:func:`precompute_fp8_scales` after ``opt.step()``, or else lazily at the
   first all-gather after the parameters changed) the global scales of all weights come from
   one packed all-reduce and each rank's rows are cast to FP8, which the all-gather sends.
   A meta-device init works in this mode (the scales follow the parameters off the meta
   device at ``model.to_empty``; the first gather casts whatever the parameters then hold).
   Where a Block2D weight's shards hold whole 128-row tiles (FSDP2's chunk of rows a multiple
   of 128) and the parameter has the model dtype, its rank quantizes its rows in one pass
   (tile amaxes are local) and only the scales are all-reduced (one packed SUM for all such
   weights); the other weights take the partial-amax cast.

Usage follows FSDP's training state, as in TE: forward gathers for the rowwise direction;
``PRE_BACKWARD`` (``reshard_after_forward=True``) for the columnwise one; with
``reshard_after_forward=False`` the forward gather serves both (Block2D: the columnwise copy
is made right after the gather; MXFP8 gathers both planes). Needs torch >= 2.6 FSDP2; reads
FSDP2's private state (``FSDPState``, its parameter group's ``_training_state``; see
``state``).

What the layer must do (TransformerEngine's protocol): ask the gathered weight for
``fp8blk_block_tensor(rowwise=True, columnwise=False)`` in forward, save the weight itself
(not its buffers) for backward, and ask ``fp8blk_block_tensor(False, True)`` in backward,
after FSDP2 re-gathered it. A layer that saves the forward's rowwise buffers instead still
works for Block2D (they are views of FSDP's all-gather storage, which the backward gather
refills in place) but transposes again; MXFP8 with ``reshard_after_forward=True`` needs the
protocol (its columnwise plane is gathered in backward only), else a clear RuntimeError.

    import torch, fp8blk.torch as fbt
    from fp8blk.torch import fsdp
    from torch.distributed.fsdp import fully_shard
    fbt.convert_to_float8_block(model)
    fsdp.prepare_fsdp_fp8(model, mode="cast")
    for layer in model.layers: fully_shard(layer)
    fully_shard(model)

The room: ``convert`` (``prepare_fsdp_fp8``), ``weights`` (the tensor subclasses and their
FSDP2 hooks), ``state`` (what is read of FSDP2's state), ``registry`` (a model's converted
weights and their FSDP2 objects), ``models`` (a model's registries), ``batch`` (the batched
master cast both modes run), ``cast`` and ``primary`` (the two modes' per-step functions).
"""
from .cast import precompute_fp8_scales
from .convert import MODES, prepare_fsdp_fp8
from .models import gathered_bytes
from .primary import cast_master_weights_, clip_master_grad_norm_, master_grads_, master_weights
from .state import param_group_of, state_name, usage_for  # noqa: F401 (FSDP2 state reads)

__all__ = ["prepare_fsdp_fp8", "precompute_fp8_scales", "master_weights", "master_grads_",
           "clip_master_grad_norm_", "cast_master_weights_", "gathered_bytes", "MODES"]
