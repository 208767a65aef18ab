"""PyTorch FSDP2 with FP8 weights on the wire (issue 14; docs/distributed.md, docs/torch.md).

With bf16 parameters FSDP2 all-gathers 2 bytes per weight element in every forward and again
in every backward. Here the all-gather carries the rowwise FP8 bytes only (1 byte per element;
no scales, no columnwise copy), the columnwise copy is the local FP8 transpose, and the block
scales are *global* (partial amax of each rank's shard, one packed MAX all-reduce for all
weights), so FSDP's shard boundaries may cut 128x128 tiles anywhere (TE's FSDP2 path needs
them on tile rows) and the gathered weight equals ``fb.quantize(bf16(full weight))`` byte for
byte.

Two ways to own the weights (convert with :func:`prepare_fsdp_fp8` after
``convert_to_float8_block`` and before ``fully_shard``):

1. ``mode="primary"`` (TransformerEngine's FP8 primary weights): the model's weights ARE FP8
   (:class:`~fp8blk.torch.weight.Float8BlockPrimaryWeight`); the optimizer updates fp32
   master shards, the flat range FSDP2 assigns to the rank::

       masters = fsdp.master_weights(model)          # fp32 leaves, one per FP8 weight
       opt = torch.optim.AdamW(masters + other_params)
       loss.backward(); fsdp.master_grads_(model, masters); opt.step()
       fsdp.cast_master_weights_(model, masters)      # one all-reduce per recipe, all weights

2. ``mode="cast"`` (torchao's float8-FSDP pattern): parameters stay bf16/fp32, wrapped in
   :class:`~fp8blk.torch.weight.Float8BlockCastWeight`; the optimizer updates them as usual.
   Once per step (:func:`precompute_fp8_scales` after ``opt.step()``, or else lazily at the
   first all-gather after the parameters changed) the global scales of all weights come from
   one packed all-reduce and each rank's rows are cast to FP8, which the all-gather sends.

Usage follows FSDP's training state, as in TE: forward gathers for the rowwise direction;
``PRE_BACKWARD`` (``reshard_after_forward=True``) for the columnwise one; with
``reshard_after_forward=False`` the forward gather serves both (Block2D: the columnwise copy
is made right after the gather; MXFP8 gathers both planes). Needs torch >= 2.6 FSDP2; uses
FSDP2's private training-state attributes (FACTS.md).

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
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from .. import _arrays, master, reference, scaling
from ..formats import Block2D, MXFP8
from ..layout import cdiv
from ._fsdp_state import param_group_of, state_name, usage_for  # noqa: F401 (public here)
from .weight import (Float8BlockCastWeight, Float8BlockPrimaryWeight, WeightState,
                     _PlaneWeight, on_torch_stream)

MODES = ("primary", "cast")


# --------------------------------------------------------------------------------------------
# Conversion


def prepare_fsdp_fp8(model: torch.nn.Module, mode: str = "cast", module_filter_fn=None,
                     recipe=None, model_dtype=torch.bfloat16) -> torch.nn.Module:
    """Make the weights of ``model``'s FP8 linear layers gather as FP8 under FSDP2; in place,
    before ``fully_shard``. Returns ``model``.

    ``mode``: "cast" (high-precision parameters, FP8 on the wire) or "primary" (FP8 primary
    weights updated from fp32 masters). ``module_filter_fn(module, fqn) -> bool`` picks the
    modules whose ``weight`` (2-D) is converted (default: every Float8BlockLinear). ``recipe``:
    the weights' recipe (default: the module's ``config.weight``, else ``fb.Block2D()``);
    Block2D or MXFP8 (both dims multiples of 32). ``model_dtype``: the dtype the FP8 bytes are
    quantized from (bf16: the gathered weight is ``quantize(bf16(w))``); float32, bfloat16
    or float16.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if model_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"model_dtype must be torch.float32, bfloat16 or float16, got "
                        f"{model_dtype}")
    if module_filter_fn is None:
        from .linear import Float8BlockLinear

        def module_filter_fn(module, fqn):
            return isinstance(module, Float8BlockLinear)
    if any(hasattr(m, "_get_fsdp_state") for m in model.modules()):
        raise ValueError("prepare_fsdp_fp8 must run before fully_shard (it replaces the "
                         "weights FSDP2 would shard)")
    registry = Registry(model)
    for fqn, module in model.named_modules():
        if not module_filter_fn(module, fqn):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{fqn or 'model'}: prepare_fsdp_fp8 needs a 2-D `weight` "
                             f"parameter, got {None if weight is None else tuple(weight.shape)}")
        if isinstance(weight, _PlaneWeight) or type(weight).__name__ == "DTensor" and \
                isinstance(weight._local_tensor, _PlaneWeight):
            raise ValueError(f"{fqn or 'model'}.weight is already converted")
        r = recipe if recipe is not None else getattr(getattr(module, "config", None),
                                                      "weight", Block2D())
        module.weight = _convert(weight, r, mode, model_dtype, fqn)
        registry.states.append(module.weight._state if not _is_dtensor(module.weight)
                               else module.weight._local_tensor._state)
        registry.states[-1].registry = registry
    return model


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _convert(weight, recipe, mode, model_dtype, fqn):
    from ..ops import quantize

    if not isinstance(recipe, (Block2D, MXFP8)):
        raise TypeError(f"{fqn}: FSDP FP8 weights are Block2D or MXFP8, got {recipe!r}")
    is_dt = _is_dtensor(weight)
    local = weight._local_tensor if is_dt else weight
    local = local.detach()
    rows, cols = local.shape
    if isinstance(recipe, MXFP8) and (rows % 32 or cols % 32):
        raise ValueError(f"{fqn}: an MXFP8 weight needs both dims to be multiples of 32, got "
                         f"{(rows, cols)}")
    if local.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{fqn}: the weight must be float32 or bfloat16 (it is the master "
                        f"for the FP8 cast), got {local.dtype}")
    state = WeightState(recipe, (rows, cols), local.dtype, model_dtype, mode, local.device)
    if mode == "cast":
        new = Float8BlockCastWeight([local.contiguous()], state)
    else:
        q = quantize(local.to(model_dtype).contiguous(), recipe, rowwise=True,
                     columnwise=isinstance(recipe, MXFP8))
        state.set_scales_from(q)
        planes = [q.rowwise_data.clone()]
        if isinstance(recipe, MXFP8):
            planes.append(q.columnwise_data.clone())
        new = Float8BlockPrimaryWeight(planes, state)
    if is_dt:  # a tensor-parallel DTensor: wrap its local shard (FSDP2 + TP)
        from torch.distributed.tensor import DTensor

        new = DTensor.from_local(new, weight.device_mesh, weight.placements,
                                 shape=weight.shape, stride=weight.stride())
    return torch.nn.Parameter(new, requires_grad=weight.requires_grad)


# --------------------------------------------------------------------------------------------
# Finding FSDP's parameter objects


class Registry:
    """The converted weights of one model, in conversion order (the same on every rank), and
    what they need from FSDP: its FSDPParam and parameter group per weight, and a TorchComm
    per shard process group."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.states = []
        self._fsdp = {}
        self._comms = {}

    def fsdp_of(self, state):
        hit = self._fsdp.get(id(state))
        if hit is None:
            self._rescan()
            hit = self._fsdp.get(id(state))
        return hit

    def _rescan(self):
        import torch.distributed._composable_state as composable
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        # the converted model's modules, and every module FSDP2 manages in this process
        # (fully_shard may have been applied to a parent of the converted model)
        model = self.model()
        modules = list(model.modules()) if model is not None else []
        modules += list(getattr(composable, "_module_state_mapping", {}).keys())
        seen = set()
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            st = composable._get_module_state(module)
            if not isinstance(st, FSDPState) or st._fsdp_param_group is None:
                continue
            group = st._fsdp_param_group
            for fp in group.fsdp_params:
                local = fp._sharded_local_tensor
                if isinstance(local, _PlaneWeight) and local._state.registry is self:
                    self._fsdp[id(local._state)] = (fp, group)

    def entries(self, mode):
        """[(state, FSDPParam)] of the weights of `mode`, in conversion order."""
        out = []
        for state in self.states:
            if state.mode != mode:
                continue
            hit = self.fsdp_of(state)
            if hit is None:
                raise RuntimeError(
                    "a converted weight is not managed by FSDP2: call fully_shard on the model "
                    "(or a module holding the weight) after prepare_fsdp_fp8")
            out.append((state, hit[0]))
        return out

    def ensure_cast(self, state):
        """Mode "cast": see :func:`ensure_cast` (the weights' hooks reach it through their
        registry: ``weight`` cannot import this module, which imports it)."""
        ensure_cast(state)

    def comm(self, fsdp_param):
        from ..comm import TorchComm

        pg = fsdp_param.mesh_info.shard_process_group
        hit = self._comms.get(id(pg))
        if hit is None:
            hit = self._comms[id(pg)] = (pg, TorchComm(pg))
        return hit[1]


def _registries(model):
    regs = []
    for p in model.parameters():
        local = p._local_tensor if _is_dtensor(p) else p
        if isinstance(local, _PlaneWeight) and local._state.registry is not None:
            if all(r is not local._state.registry for r in regs):
                regs.append(local._state.registry)
    return regs


# --------------------------------------------------------------------------------------------
# The batched master cast (modes 1 and 2)


def _shard_place(fsdp_param, rows, cols):
    """(first flat index, element count, chunk rows) of this rank's FSDP2 shard of an
    (rows, cols) weight: torch.chunk along dim 0, ceil(rows / world) rows per rank."""
    ws = fsdp_param.mesh_info.shard_mesh_size
    rank = fsdp_param.mesh_info.shard_mesh_rank
    chunk = cdiv(rows, ws)
    r0 = min(rank * chunk, rows)
    r1 = min(r0 + chunk, rows)
    return r0 * cols, (r1 - r0) * cols, chunk


def _internal(t, cache=None, key=None):
    """The flat internal (NumPy / CuPy) array of torch tensor `t` (None if empty). With a
    `cache` dict, the array made for `key` is reused while `t`'s address, size and dtype are
    the same (masters and local rows persist across steps; a DLPack import costs ~24 us on
    the GPU)."""
    if t is None or t.numel() == 0:
        return None
    if cache is None:
        return _arrays.to_backend(t.reshape(-1))[0]
    sig = (t.data_ptr(), t.numel(), t.dtype)
    hit = cache.get(key)
    if hit is None or hit[0] != sig:
        hit = cache[key] = (sig, _arrays.to_backend(t.reshape(-1))[0])
    return hit[1]


def _cast_all(entries, masters, frags, comm):
    """One batched ``cast_master_weights`` over the entries (scale-only weight BlockTensors,
    bytes into the fragments): one all-reduce per recipe bucket for all weights."""
    by_dtype = {}
    for i, (state, fp) in enumerate(entries):
        by_dtype.setdefault(state.model_dtype, []).append(i)
    device = entries[0][0].scales[0].is_cuda if entries else False
    for model_dtype, idx in by_dtype.items():
        items = []
        for j, i in enumerate(idx):
            state, fp = entries[i]
            rows, cols = state.shape
            start, count, _ = _shard_place(fp, rows, cols)
            m = masters[i]
            cache = state.internal_cache
            arr = _internal(m, cache, "master") if count else None
            mdtype = _arrays.numpy_dtype(m.dtype) if arr is not None else None
            f_row, f_col = frags[i]
            it = master.Item(j, state.scale_tensor, rows, cols, state.recipe, arr, mdtype,
                             start if count else 0, count if arr is not None else 0,
                             rowwise=True, columnwise=isinstance(state.recipe, MXFP8),
                             frag_row=_internal(f_row, cache, "row") if count else None,
                             frag_col=_internal(f_col, cache, "col") if count else None)
            items.append(it)
        with on_torch_stream(device):
            master.cast_batch(items, comm, _arrays.numpy_dtype(model_dtype), have_fragments=True,
                              device=device)


# --------------------------------------------------------------------------------------------
# Mode 2: high-precision parameters, FP8 on the wire


def precompute_fp8_scales(model: torch.nn.Module) -> None:
    """Mode "cast": global tile scales of every converted weight of ``model`` from ONE packed
    partial-amax all-reduce (per recipe), and each rank's rows cast to FP8 with them, ready
    for the next all-gathers. Call after ``optimizer.step()`` on every rank (else it happens
    lazily at the first gather after the parameters changed)."""
    for reg in _registries(model):
        _recast(reg)


def _recast(registry):
    entries = registry.entries("cast")
    if not entries:
        return
    masters, frags = [], []
    for state, fp in entries:
        rows, cols = state.shape
        start, count, chunk = _shard_place(fp, rows, cols)
        local = fp._sharded_local_tensor
        hp = local._planes[0]
        if state.frags is None or state.frags[0].shape[0] != chunk:
            state.frags = [hp.new_zeros((chunk, cols), dtype=torch.uint8)
                           for _ in state.planes]
        masters.append(hp.reshape(-1)[:count] if count else None)
        frags.append(tuple(f.reshape(-1)[:count] for f in state.frags) + (None,) * (
            2 - len(state.frags)))
    _cast_all(entries, masters, frags, registry.comm(entries[0][1]))
    for state, fp in entries:
        state.cast_version = fp.sharded_param._version


def ensure_cast(state):
    """Mode "cast", in the pre-all-gather hook: re-cast every weight of the model when this
    one's parameter changed since its bytes were cast (every rank decides alike: the
    optimizer's in-place update bumps the version of every rank's shard)."""
    hit = state.registry.fsdp_of(state)
    if state.frags is None or state.cast_version != hit[0].sharded_param._version:
        _recast(state.registry)


# --------------------------------------------------------------------------------------------
# Mode 1: FP8 primary weights from fp32 masters


def _primary_entries(model):
    out = []
    for reg in _registries(model):
        out += [(reg, s, fp) for s, fp in reg.entries("primary")]
    return out


def master_weights(model: torch.nn.Module) -> list:
    """Mode "primary": fp32 master shards, one per FP8 weight of ``model`` (in a fixed order):
    the flat elements [o, o+n) of the row-major weight that FSDP2 gave this rank (the rows it
    holds), as 1-D fp32 leaf tensors with ``requires_grad=True``, initialized to the FP8
    weight's values (dequantized). Pass them to the optimizer."""
    out = []
    for reg, state, fp in _primary_entries(model):
        rows, cols = state.shape
        start, count, _ = _shard_place(fp, rows, cols)
        local = fp._sharded_local_tensor
        vals = _dequantize_rows(state, local._planes[0], start // cols)
        out.append(vals.reshape(-1).float().clone().requires_grad_(True))
    return out


def _dequantize_rows(state, row_bytes, r0):
    """fp32 values of the rowwise FP8 bytes of rows [r0, r0 + len) (global scales)."""
    rows, cols = row_bytes.shape
    fmt = state.recipe.fmt
    table = torch.from_numpy(reference.fp8_decode_table(fmt).copy()).to(row_bytes.device)
    vals = table[row_bytes.long()]
    if rows == 0:
        return vals
    sinv = state.scales[0]
    if isinstance(state.recipe, Block2D):
        idx_r = torch.arange(r0, r0 + rows, device=sinv.device) // 128
        idx_c = torch.arange(cols, device=sinv.device) // 128
        return vals * sinv[idx_r][:, idx_c]
    codes = sinv[r0:r0 + rows, : cols // 32].cpu().numpy()
    mult = torch.from_numpy(scaling.e8m0_decode(codes).astype(np.float32)).to(vals.device)
    return vals * mult.repeat_interleave(32, dim=1)


def master_grads_(model: torch.nn.Module, masters: list) -> None:
    """Mode "primary": ``master.grad`` = this rank's sharded gradient of each FP8 weight, as
    fp32 (FSDP2 reduce-scatters the weights' gradients as usual), and the weight's own
    ``.grad`` cleared (the gradient moves: the next backward starts from none, as
    ``optimizer.zero_grad`` does for the masters). Call after backward."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    for (reg, state, fp), m in zip(entries, masters):
        g = fp.sharded_param.grad
        if g is None:
            m.grad = None
            continue
        g = g._local_tensor if _is_dtensor(g) else g
        m.grad = g.reshape(-1).to(torch.float32)
        fp.sharded_param.grad = None


def _check_masters(entries, masters):
    if not isinstance(masters, (list, tuple)) or len(masters) != len(entries):
        raise ValueError(f"masters must be the list from master_weights(model) ({len(entries)} "
                         f"tensors), got {type(masters).__name__} of "
                         f"{len(masters) if hasattr(masters, '__len__') else '?'}")
    for (reg, state, fp), m in zip(entries, masters):
        rows, cols = state.shape
        start, count, _ = _shard_place(fp, rows, cols)
        if not isinstance(m, torch.Tensor) or m.dim() != 1 or m.numel() != count:
            raise ValueError(f"masters: expected a 1-D tensor of {count} elements (this rank's "
                             f"shard of a {state.shape} weight), got "
                             f"{getattr(m, 'shape', type(m).__name__)}")


@torch.no_grad()
def cast_master_weights_(model: torch.nn.Module, masters: list) -> None:
    """Mode "primary": write every FP8 weight of ``model`` from its fp32 master shard with ONE
    all-reduce per recipe for all weights (``fb.cast_master_weights`` over a TorchComm of the
    FSDP mesh): each rank writes the bytes of its own rows, every rank the global scales. After
    the all-gather, each weight equals ``quantize(bf16(full master))`` byte for byte."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    by_reg = {}
    for (reg, state, fp), m in zip(entries, masters):
        by_reg.setdefault(id(reg), (reg, []))[1].append((state, fp, m))
    for reg, group in by_reg.values():
        ents = [(s, fp) for s, fp, _ in group]
        ms, frags = [], []
        for state, fp, m in group:
            planes = fp._sharded_local_tensor._planes
            ms.append(m.detach())
            frags.append((planes[0].reshape(-1),
                          planes[1].reshape(-1) if len(planes) > 1 else None))
        _cast_all(ents, ms, frags, reg.comm(ents[0][1]))


def gathered_bytes(model: torch.nn.Module) -> list:
    """Per converted weight, the log of its pre-all-gathers (dicts: training state, usage,
    planes sent, bytes this rank sent, world size, padded element count)."""
    return [list(s.gathers) for reg in _registries(model) for s in reg.states]


__all__ = ["prepare_fsdp_fp8", "precompute_fp8_scales", "master_weights", "master_grads_",
           "cast_master_weights_", "gathered_bytes", "MODES"]
