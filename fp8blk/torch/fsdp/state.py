"""What fp8blk reads of FSDP2's state: the parameter group that holds a weight, the usage
(rowwise / columnwise) its training state needs, a parameter's local tensor and this rank's
shard of it. Uses FSDP2's private training-state attributes (torch >= 2.6). Shared by
``weights`` (the hooks), ``registry`` and the two modes' casts.

The hooks run before every all-gather: FSDP2's names are imported once, at the first hook
(torch.distributed may be missing from a torch build, so not when fp8blk.torch is imported)."""
from __future__ import annotations

from ...layout import cdiv

_FSDP = {}  # FSDP2's names, filled by _fsdp()
_NAMES = {}  # id(TrainingState member) -> its name (Enum.name and hash are Python calls)


def _fsdp():
    if not _FSDP:
        from torch.distributed._composable_state import _get_module_state
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        _FSDP.update(get_module_state=_get_module_state, FSDPState=FSDPState,
                     PRE_BACKWARD=TrainingState.PRE_BACKWARD)
    return _FSDP


def fsdp_param_of(state, module):
    """(FSDPParam, FSDP2 parameter group) of the weight of `state` (the hook's `module` owns
    it). Raises RuntimeError when FSDP state has no parameter group (as TransformerEngine
    does). The hooks call it once per module and keep the answer (:class:`WeightState`)."""
    names = _fsdp()
    st = names["get_module_state"](module) if module is not None else None
    if isinstance(st, names["FSDPState"]) and st._fsdp_param_group is None:
        raise RuntimeError(
            f"FSDP2 state of {type(module).__name__} has no parameter group, so the FP8 "
            f"weight cannot tell the training state (forward / backward) it is gathered for: "
            f"call fully_shard on a module that holds the weight's parameters")
    hit = state.registry.fsdp_of(state) if state.registry is not None else None
    if hit is None:
        raise RuntimeError(
            f"no FSDP2 parameter group holds this FP8 weight ({state.shape}): convert the "
            f"model with prepare_fsdp_fp8 and then call fully_shard on it")
    return hit


def param_group_of(state, module):
    """FSDP2 parameter group holding the weight of `state` (see :func:`fsdp_param_of`)."""
    return fsdp_param_of(state, module)[1]


def usage_for(group):
    """(rowwise, columnwise) the gathered weight must provide, from the group's training
    state: PRE_BACKWARD -> columnwise (dgrad); forward with reshard_after_forward -> rowwise;
    forward without resharding -> both (the backward pass reuses this gather). (FSDP runs the
    hooks under no_grad, so an inference-only forward cannot be told apart here.)"""
    if group._training_state is (_FSDP or _fsdp())["PRE_BACKWARD"]:
        return False, True
    if group._reshard_after_forward:
        return True, False
    return True, True


def state_name(group) -> str:
    st = group._training_state
    name = _NAMES.get(id(st))
    if name is None:
        name = _NAMES[id(st)] = st.name
    return name


def shard_place(fsdp_param, rows, cols):
    """(first flat index, element count, chunk rows) of this rank's FSDP2 shard of an
    (rows, cols) weight: torch.chunk along dim 0, ceil(rows / world) rows per rank."""
    ws = fsdp_param.mesh_info.shard_mesh_size
    rank = fsdp_param.mesh_info.shard_mesh_rank
    chunk = cdiv(rows, ws)
    r0 = min(rank * chunk, rows)
    r1 = min(r0 + chunk, rows)
    return r0 * cols, (r1 - r0) * cols, chunk


def local_of(fsdp_param):
    """The sharded parameter's local tensor (FSDPParam._sharded_local_tensor without its
    typing.cast: two Python calls per weight per step)."""
    return fsdp_param.sharded_param._local_tensor
