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
       loss.backward(); fsdp.master_grads_(model, masters)
       fsdp.clip_master_grad_norm_(model, masters, 1.0, other_parameters=other_params)
       opt.step()
       fsdp.cast_master_weights_(model, masters)      # one all-reduce per recipe, all weights

   Checkpoints: :mod:`fp8blk.torch.checkpoint` (``master_state_dict``).

2. ``mode="cast"`` (torchao's float8-FSDP pattern): parameters stay bf16/fp32, wrapped in
   :class:`~fp8blk.torch.weight.Float8BlockCastWeight`; the optimizer updates them as usual.
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
``_fsdp_state``).

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

import copy
import functools
import weakref

import numpy as np
import torch

from .. import _arrays, master, reference, scaling
from ..formats import Block2D, MXFP8
from ..layout import cdiv
from ..ops import quantize_into
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
    _REGISTRIES.generation += 1  # the models' registry lists may have changed
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
    if local.is_meta and mode == "primary":
        raise ValueError(f"{fqn}: mode 'primary' quantizes the weight when converting it, so it "
                         f"needs the weight's values: initialize the model on a device before "
                         f"prepare_fsdp_fp8, or use mode='cast' (which supports a meta-device "
                         f"init followed by model.to_empty)")
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
        self._entries = {}  # mode -> its entries, once FSDP2 manages every weight of it
        self.tile_split = None  # mode 2: (tile-local entries, the others), once found
        self.tile_pack = None   # mode 2: the tile-local weights' packed scales

    def __deepcopy__(self, memo):
        """A registry of the copied states (see WeightState.__deepcopy__), its FSDP2 lookups
        and communicators to be found again; the model, if it is being copied too, its copy."""
        new = copy.copy(self)
        memo[id(self)] = new
        model = self.model()
        if model is not None and id(model) in memo:
            new.model = weakref.ref(memo[id(model)])
        new.states = copy.deepcopy(self.states, memo)
        new._fsdp, new._comms, new._entries = {}, {}, {}
        new.tile_split = new.tile_pack = None
        return new

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
                local = _local_of(fp)
                if isinstance(local, _PlaneWeight) and local._state.registry is self:
                    self._fsdp[id(local._state)] = (fp, group)

    def entries(self, mode):
        """[(state, FSDPParam, first flat index, element count, chunk rows)] of the weights
        of `mode`, in conversion order: this rank's shard of each (see _shard_place). Kept
        once found: the weights and FSDP2's parameters of a model do not change."""
        hit = self._entries.get(mode)
        if hit is not None:
            return hit
        out = []
        for state in self.states:
            if state.mode != mode:
                continue
            found = self.fsdp_of(state)
            if found is None:
                raise RuntimeError(
                    "a converted weight is not managed by FSDP2: call fully_shard on the model "
                    "(or a module holding the weight) after prepare_fsdp_fp8")
            fp = found[0]
            out.append((state, fp) + _shard_place(fp, *state.shape))
            state.shard_place = out[-1][2:4]
        self._entries[mode] = out
        return out

    def ensure_cast(self, state):
        """Mode "cast", in the pre-all-gather hook (which reaches it through the registry:
        ``weight`` cannot import this module, which imports it): re-cast every weight of the
        model when this one's parameter changed since its bytes were cast (every rank decides
        alike: the optimizer's in-place update bumps the version of every rank's shard).
        Two counts tell: the sharded parameter's version (the optimizer, ``load_state_dict``)
        and the state's count of plain-tensor copies into a shard (torch.distributed.
        checkpoint's load writes the local shards past the DTensor)."""
        hit = state.fsdp if state.fsdp is not None else self.fsdp_of(state)
        if state.frags is None or state.cast_version != _cast_version(state, hit[0]):
            _recast(self)

    def local_values(self, state, row_bytes):
        """Mode "primary": fp32 values of this rank's rows of `state`'s weight, given their
        rowwise FP8 bytes (on any device: the scales' device computes them); the rows start
        at this rank's FSDP2 shard (row 0 when FSDP2 does not manage the weight)."""
        rows, cols = state.shape
        if state.shard_place is not None:  # (a deep copy of the state keeps it)
            r0, count = state.shard_place
        else:
            found = self.fsdp_of(state)
            r0, count = _shard_place(found[0], rows, cols)[:2] if found else (0, rows * cols)
        if row_bytes.shape != (count // cols, cols):
            raise RuntimeError(f"the values of an FP8 primary weight are defined for this rank's "
                               f"whole shard ({count // cols} x {cols}), not for a "
                               f"{tuple(row_bytes.shape)} part of it")
        r0 //= cols
        dev = state.scales[0].device
        return _dequantize_rows(state, row_bytes.to(dev), r0).to(row_bytes.device)

    def comm(self, fsdp_param):
        pg = self.process_group(fsdp_param)
        hit = self._comms.get(id(pg))
        if hit is None:
            from ..comm import TorchComm

            hit = self._comms[id(pg)] = (pg, TorchComm(pg))
        return hit[1]

    def process_group(self, fsdp_param):
        """The torch process group the weight is sharded over."""
        return fsdp_param.mesh_info.shard_process_group


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


def _registries(model):
    return _REGISTRIES.of(model)


def _scan_registries(model):
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


def _local_of(fsdp_param):
    """The sharded parameter's local tensor (FSDPParam._sharded_local_tensor without its
    typing.cast: two Python calls per weight per step)."""
    return fsdp_param.sharded_param._local_tensor


def _flat_array(t):
    """The flat internal (NumPy / CuPy) array of torch tensor `t` (None if empty)."""
    if t is None or t.numel() == 0:
        return None
    return _arrays.to_backend(t.detach().reshape(-1))[0]


def _cast_item(j, entry, key, sources, *args):
    """The master.Item of one weight (a scale-only weight BlockTensor, bytes into fragments),
    reused while `key` -- where its master and fragment tensors are (addresses, sizes,
    dtypes) -- is unchanged: building one imports them through DLPack (~24 us each on the
    GPU). ``sources(entry, *args)`` gives the (master, row fragment, column fragment) torch
    tensors, each flat and `count` long (or None), when the Item must be built."""
    state = entry[0]
    hit = state.cast_items.get(j)
    if hit is None or hit[0] != key:
        hit = state.cast_items[j] = (key, _new_item(j, entry, *sources(entry, *args)))
    return hit[1]


def _new_item(j, entry, m, f_row, f_col):
    state, fp, start, count, chunk = entry
    rows, cols = state.shape
    arr = _flat_array(m) if count else None
    mdtype = _arrays.numpy_dtype(m.dtype) if arr is not None else None
    return master.Item(j, state.scale_tensor, rows, cols, state.recipe, arr, mdtype,
                       start if count else 0, count if arr is not None else 0,
                       rowwise=True, columnwise=isinstance(state.recipe, MXFP8),
                       frag_row=_flat_array(f_row) if count else None,
                       frag_col=_flat_array(f_col) if count else None)


def _cast_all(registry, entries, item_of):
    """One batched ``cast_master_weights`` over the entries, one all-reduce per recipe bucket
    for all weights. ``item_of(j, i, entry)``: the master.Item of entry i, j-th of its
    model-dtype bucket."""
    by_dtype = {}
    for i, entry in enumerate(entries):
        by_dtype.setdefault(entry[0].model_dtype, []).append(i)
    device = entries[0][0].scales[0].is_cuda if entries else False
    comm = registry.comm(entries[0][1]) if entries else None
    for model_dtype, idx in by_dtype.items():
        items = [item_of(j, i, entries[i]) for j, i in enumerate(idx)]
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
    for state, fp, start, count, chunk in entries:
        if state.frags is None or state.frags[0].shape[0] != chunk:
            hp = _local_of(fp)._planes[0]
            state.frags = [hp.new_zeros((chunk, state.shape[1]), dtype=torch.uint8)
                           for _ in state.planes]
    split = registry.tile_split
    if split is None:
        split = registry.tile_split = _split_tile_local(entries)
    local, other = split
    if local:
        _cast_tile_local(registry, local)
    if other:
        _cast_all(registry, other, _cast_mode_item)
    for state, fp, *_ in entries:
        state.cast_version = _cast_version(state, fp)


def _cast_version(state, fsdp_param):
    return fsdp_param.sharded_param._version, state.writes


def _split_tile_local(entries):
    """(tile-local entries, the others): a Block2D weight whose shard holds whole 128-row
    tiles (FSDP2's chunk of rows a multiple of 128: the same on every rank) and whose
    parameter already has the model dtype is cast tile by tile on its own rank -- every
    tile's amax is local, so ``quantize`` of the local rows writes the bytes and those
    tiles' scales of ``quantize(bf16(full weight))`` in one pass; only the scales travel.
    The others take the batched partial-amax cast."""
    local, other = [], []
    for e in entries:
        state, fp, start, count, chunk = e
        ok = (isinstance(state.recipe, Block2D) and chunk % 128 == 0
              and _local_of(fp)._planes[0].dtype == state.model_dtype)
        (local if ok else other).append(e)
    return local, other


class _TilePack:
    """One fp32 buffer holding the rowwise scale_inv of every tile-local weight (views in
    conversion order): each rank zeroes it, writes its own tiles' rows, and one SUM
    all-reduce gives every rank all scales (each entry has one nonzero addend, so the sum is
    exact: x + 0 = x, NaN stays NaN)."""

    def __init__(self, entries):
        scales = [e[0].scales[0] for e in entries]
        sizes = [t.numel() for t in scales]
        self.buf = torch.empty(sum(sizes), dtype=torch.float32, device=scales[0].device)
        self.views, o = [], 0
        for t, n in zip(scales, sizes):
            self.views.append(self.buf[o:o + n].view(t.shape))
            o += n
        self.scales = scales


def _cast_tile_local(registry, entries):
    from ..ops import quantize

    pack = registry.tile_pack
    if pack is None:
        pack = registry.tile_pack = _TilePack(entries)
    pack.buf.zero_()
    for (state, fp, start, count, chunk), view in zip(entries, pack.views):
        if not count:
            continue
        cols = state.shape[1]
        rows = count // cols
        t0 = start // cols // 128
        x2d = _local_of(fp)._planes[0].reshape(-1)[:count].view(rows, cols)
        data, sinv = state.frags[0][:rows], view[t0:t0 + cdiv(rows, 128)]
        if x2d.is_cuda:  # straight into the fragment and the packed scales
            quantize_into(x2d, state.recipe, True, False, _arrays.numpy_dtype(x2d.dtype),
                          (data, sinv, None, None))
        else:
            q = quantize(x2d, state.recipe, rowwise=True)
            data.copy_(q.rowwise_data)
            sinv.copy_(q.rowwise_scale_inv)
    pg = registry.process_group(entries[0][1])
    if pg.size() > 1:
        torch.distributed.all_reduce(pack.buf, group=pg)
    torch._foreach_copy_(pack.scales, pack.views)


def _cast_mode_item(j, i, entry):
    """The Item of a mode-2 weight: its parameter's rows, bytes into its fragments."""
    state, fp = entry[0], entry[1]
    hp = _local_of(fp)._planes[0]
    frags = state.frags
    key = (hp.data_ptr(), hp.dtype, hp.numel(), frags[0].data_ptr(), frags[-1].data_ptr())
    return _cast_item(j, entry, key, _cast_mode_sources)


def _cast_mode_sources(entry):
    state, fp, start, count, chunk = entry
    flat = [f.reshape(-1)[:count] for f in state.frags] + [None]
    return _local_of(fp)._planes[0].reshape(-1)[:count], flat[0], flat[1]


# --------------------------------------------------------------------------------------------
# Mode 1: FP8 primary weights from fp32 masters


def _primary_entries(model):
    out = []
    for reg in _registries(model):
        out += [(reg, entry) for entry in reg.entries("primary")]
    return out


def master_weights(model: torch.nn.Module) -> list:
    """Mode "primary": fp32 master shards, one per FP8 weight of ``model`` (in a fixed order):
    the flat elements [o, o+n) of the row-major weight that FSDP2 gave this rank (the rows it
    holds), as 1-D fp32 leaf tensors with ``requires_grad=True``, initialized to the FP8
    weight's values (dequantized). Pass them to the optimizer."""
    out = []
    for reg, (state, fp, *_) in _primary_entries(model):
        vals = reg.local_values(state, _local_of(fp)._planes[0])
        out.append(vals.reshape(-1).float().clone().requires_grad_(True))
    return out


def primary_shards(model: torch.nn.Module, masters: list) -> list:
    """Internal door (fp8blk.torch.checkpoint): per FP8 primary weight of ``model``, in
    :func:`master_weights`' order, the sharded parameter FSDP2 registered on the module (a
    DTensor) and its local shape, once ``masters`` is checked to be one 1-D shard per
    weight (ValueError otherwise)."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    return [(fp.sharded_param, tuple(_local_of(fp).shape)) for reg, (state, fp, *_) in entries]


def as_sharded(t, param, local_shape):
    """Internal door: `t`, this rank's flat shard of a weight (a master, its gradient or an
    optimizer state of it), seen as a DTensor with the weight's FSDP2 sharding and shape (a
    view: writes reach `t`)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.detach().view(local_shape), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)


def clip_master_grad_norm_(model: torch.nn.Module, masters: list, max_norm: float,
                           norm_type: float = 2.0, other_parameters=(),
                           error_if_nonfinite: bool = False) -> torch.Tensor:
    """Mode "primary": ``torch.nn.utils.clip_grad_norm_`` over the masters' gradients (after
    :func:`master_grads_`) and the gradients of ``other_parameters`` (the model's other
    parameters the optimizer updates, e.g. norms and embeddings under FSDP2). The norm is the
    one of the whole weights: each master's gradient is seen as a DTensor with its weight's
    FSDP2 sharding, so every rank gets the same norm and scales by the same factor.
    (``torch.nn.utils.clip_grad_norm_(masters, ...)`` would see plain tensors and use each
    rank's own shard: a different factor per rank.) Returns the total norm, a plain tensor,
    equal on every rank.

        fsdp.master_grads_(model, masters)
        fsdp.clip_master_grad_norm_(model, masters, 1.0, other_parameters=others)
        opt.step()
    """
    from torch.distributed.tensor import DTensor

    shards = primary_shards(model, masters)
    sharded = [as_sharded(m.grad, p, shape) for (p, shape), m in zip(shards, masters)
               if m.grad is not None]
    others = [p.grad for p in other_parameters if p.grad is not None]
    dist_grads = sharded + [g for g in others if isinstance(g, DTensor)]
    plain = [g for g in others if not isinstance(g, DTensor)]
    norms = []
    for group in (dist_grads, plain):
        if group:
            n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.tensor(0.0)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
        torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # the scaling is elementwise: each rank scales its own shards (torch's clip_grads_with_norm_
    # formula)
    local = [m.grad for m in masters if m.grad is not None] + \
        [g.to_local() if isinstance(g, DTensor) else g for g in others]
    by_device = {}
    for g in local:
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total


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
    # (setup only: master_weights runs once, so this host copy is no per-step sync)
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
    dst, src = [], []
    for (reg, (state, fp, *_)), m in zip(entries, masters):
        param = fp.sharded_param
        g = param.grad
        if g is None:
            m.grad = None
            continue
        g = (g._local_tensor if _is_dtensor(g) else g).reshape(-1)
        param.grad = None
        if g.dtype == torch.float32:  # the gradient itself becomes the master's
            m.grad = g
            continue
        m.grad = torch.empty(g.numel(), dtype=torch.float32, device=g.device)
        dst.append(m.grad)
        src.append(g)
    if dst:
        # one multi-tensor copy: on the H200 bf16 -> fp32 of 4 x 32M elements takes 259 us
        # this way, 396 us as 4 tensor.to(float32) calls (torch's casting copy kernel)
        torch._foreach_copy_(dst, src)


def _check_masters(entries, masters):
    if not isinstance(masters, (list, tuple)) or len(masters) != len(entries):
        raise ValueError(f"masters must be the list from master_weights(model) ({len(entries)} "
                         f"tensors), got {type(masters).__name__} of "
                         f"{len(masters) if hasattr(masters, '__len__') else '?'}")
    for (reg, (state, fp, start, count, chunk)), m in zip(entries, masters):
        if not isinstance(m, torch.Tensor) or m.dim() != 1 or m.numel() != count:
            raise ValueError(f"masters: expected a 1-D tensor of {count} elements (this rank's "
                             f"shard of a {state.shape} weight), got "
                             f"{getattr(m, 'shape', type(m).__name__)}")


@torch.no_grad()
def cast_master_weights_(model: torch.nn.Module, masters: list) -> None:
    """Mode "primary": write every FP8 weight of ``model`` from its fp32 master shard with ONE
    all-reduce per recipe for all weights (``fb.cast_master_weights``' batched cast over a
    TorchComm of the FSDP mesh, without its rank-agreement header -- FSDP2 gives every rank
    the same weights and shards -- so the host never waits for the GPU): each rank writes the
    bytes of its own rows, every rank the global scales. After the all-gather, each weight
    equals ``quantize(bf16(full master))`` byte for byte."""
    entries = _primary_entries(model)
    _check_masters(entries, masters)
    by_reg = {}
    for (reg, entry), m in zip(entries, masters):
        by_reg.setdefault(id(reg), (reg, [], []))
        by_reg[id(reg)][1].append(entry)
        by_reg[id(reg)][2].append(m)
    for reg, ents, ms in by_reg.values():
        _cast_all(reg, ents, functools.partial(_primary_item, ms))


def _primary_item(masters, j, i, entry):
    """The Item of a mode-1 weight: master `masters[i]`, bytes into the local planes."""
    m = masters[i]
    planes = _local_of(entry[1])._planes
    key = (m.data_ptr(), m.dtype, planes[0].data_ptr(), planes[-1].data_ptr(),
           planes[0].numel())
    return _cast_item(j, entry, key, _primary_sources, m)


def _primary_sources(entry, m):
    planes = _local_of(entry[1])._planes
    return m, planes[0].reshape(-1), planes[1].reshape(-1) if len(planes) > 1 else None


def gathered_bytes(model: torch.nn.Module) -> list:
    """Per converted weight, the log of its pre-all-gathers (dicts: training state, usage,
    planes sent, bytes this rank sent, world size, padded element count)."""
    return [list(s.gathers) for reg in _registries(model) for s in reg.states]


__all__ = ["prepare_fsdp_fp8", "precompute_fp8_scales", "master_weights", "master_grads_",
           "clip_master_grad_norm_", "cast_master_weights_", "gathered_bytes", "MODES"]
