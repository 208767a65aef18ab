"""The converted weights of one model (one ``prepare_fsdp_fp8`` call) and their per-step
work: :class:`Registry` (each weight's FSDPParam, parameter group and shard, a TorchComm per
shard process group), the model's registries, the batched master cast both modes run, and
mode "cast"'s re-cast of the FP8 fragments the all-gather sends (docs/torch.md)."""
from __future__ import annotations

import copy
import weakref

import numpy as np
import torch

from ... import _arrays, master, reference, scaling
from ...comm.agree import all_agree, fingerprint
from ...formats import Block2D, MXFP8
from ...layout import cdiv
from ...ops import quantize_buffers, quantize_into
from ..linear.module import is_dtensor
from .weights import PlaneWeight, local_of, shard_place


# --------------------------------------------------------------------------------------------
# A model's registries


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


def registries_of(model):
    """The registries of the converted weights in ``model`` (a model may hold weights
    converted by several ``prepare_fsdp_fp8`` calls), kept until the next conversion."""
    return _REGISTRIES.of(model)


def conversions_changed():
    """Called by ``prepare_fsdp_fp8``: the models' registry lists may have changed."""
    _REGISTRIES.generation += 1


def _scan_registries(model):
    regs = []
    for p in model.parameters():
        local = p._local_tensor if is_dtensor(p) else p
        if isinstance(local, PlaneWeight) and local.weight_state.registry is not None:
            if all(r is not local.weight_state.registry for r in regs):
                regs.append(local.weight_state.registry)
    return regs


def gathered_bytes(model: torch.nn.Module) -> list:
    """Per converted weight, the log of its pre-all-gathers (dicts: training state, usage,
    planes sent, bytes this rank sent, world size, padded element count)."""
    return [list(s.gathers) for reg in registries_of(model) for s in reg.states]


# --------------------------------------------------------------------------------------------
# The batched master cast both modes run: fp8blk.master.cast_batch over a model's weights, one
# all-reduce per recipe bucket, the bytes written into each rank's own rows. An entry is
# (state, FSDPParam, first flat index, element count, chunk rows): Registry.entries.


def _flat_array(t):
    """The flat internal (NumPy / CuPy) array of torch tensor `t` (None if empty)."""
    if t is None or t.numel() == 0:
        return None
    return _arrays.to_backend(t.detach().reshape(-1))[0]


def cast_item(j, entry, key, sources, *args):
    """The master.Item of one weight (a scale-only weight BlockTensor, bytes into fragments),
    reused while `key` -- where its master and fragment tensors are (addresses, sizes,
    dtypes) -- is unchanged: building one imports them through DLPack (costly on the
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


def cast_all(registry, entries, item_of):
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


class on_torch_stream:
    """On CUDA, run fp8blk's CuPy work (the master cast, whose batch works on CuPy arrays) on
    torch's current stream, so it is ordered with the torch work around it (FSDP runs the
    pre-all-gather hook on its copy-in stream). A no-op on the CPU."""

    __slots__ = ("ctx",)

    def __init__(self, cuda: bool):
        self.ctx = None
        if cuda:
            import cupy

            stream = _arrays.torch_raw_stream()(torch.cuda.current_device())
            self.ctx = cupy.cuda.ExternalStream(stream)

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# --------------------------------------------------------------------------------------------
# Mode "cast": the re-cast of the FP8 fragments. A Block2D weight whose shards hold whole
# 128-row tiles and whose parameter has the model dtype is quantized on its own rank, only its
# scales all-reduced (one packed SUM); the others take the batched partial-amax cast above.


def recast(registry):
    """Cast every mode "cast" weight of `registry`: its fragments (this rank's rows as FP8,
    padded to FSDP2's chunk) and the global scales, and record what the bytes come from."""
    entries = registry.entries("cast")
    if not entries:
        return
    for state, fp, start, count, chunk in entries:
        if state.frags is None or state.frags[0].shape[0] != chunk:
            hp = local_of(fp).planes[0]
            state.frags = [hp.new_zeros((chunk, state.shape[1]), dtype=torch.uint8)
                           for _ in state.planes]
    split = registry.tile_split
    if split is None:
        registry.ensure_agreed("cast")   # before the first collective sized by them
        split = registry.tile_split = _split_tile_local(entries)
    local, other = split
    if local:
        _cast_tile_local(registry, local)
    if other:
        cast_all(registry, other, _cast_mode_item)
    for state, fp, *_ in entries:
        state.cast_version = cast_version(state, fp)


def cast_version(state, fsdp_param):
    """What a weight's cast bytes come from: (the sharded parameter's version, the state's
    count of plain-tensor copies into a shard)."""
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
              and local_of(fp).planes[0].dtype == state.model_dtype)
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
        x2d = local_of(fp).planes[0].reshape(-1)[:count].view(rows, cols)
        data, sinv = state.frags[0][:rows], view[t0:t0 + cdiv(rows, 128)]
        if x2d.is_cuda:  # straight into the fragment and the packed scales
            quantize_into(x2d, state.recipe, True, False, _arrays.numpy_dtype(x2d.dtype),
                          (data, sinv, None, None))
        else:
            rd, rs, _, _ = quantize_buffers(x2d, state.recipe, rowwise=True)
            data.copy_(rd)
            sinv.copy_(rs)
    pg = registry.process_group(entries[0][1])
    if pg.size() > 1:
        torch.distributed.all_reduce(pack.buf, group=pg)
    torch._foreach_copy_(pack.scales, pack.views)


def _cast_mode_item(j, i, entry):
    """The Item of a mode "cast" weight: its parameter's rows, bytes into its fragments."""
    state, fp = entry[0], entry[1]
    hp = local_of(fp).planes[0]
    frags = state.frags
    key = (hp.data_ptr(), hp.dtype, hp.numel(), frags[0].data_ptr(), frags[-1].data_ptr())
    return cast_item(j, entry, key, _cast_mode_sources)


def _cast_mode_sources(entry):
    state, fp, start, count, chunk = entry
    flat = [f.reshape(-1)[:count] for f in state.frags] + [None]
    return local_of(fp).planes[0].reshape(-1)[:count], flat[0], flat[1]


# --------------------------------------------------------------------------------------------
# The registry


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
        self.tile_split = None  # mode "cast": (tile-local entries, the others), once found
        self.tile_pack = None   # mode "cast": the tile-local weights' packed scales
        self.agreed = set()     # the modes whose weights every rank was found to hold alike

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
        new.agreed = set()
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
                local = local_of(fp)
                if isinstance(local, PlaneWeight) and local.weight_state.registry is self:
                    self._fsdp[id(local.weight_state)] = (fp, group)

    def entries(self, mode):
        """[(state, FSDPParam, first flat index, element count, chunk rows)] of the weights
        of `mode`, in conversion order: this rank's shard of each (see state.shard_place). Kept
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
            out.append((state, fp) + shard_place(fp, *state.shape))
            state.shard_place = out[-1][2:4]
        self._entries[mode] = out
        return out

    def ensure_agreed(self, mode):
        """Raise the same ValueError on every rank unless all ranks hold the same weights of
        `mode` (count, shapes, recipes, dtypes, FSDP2's chunk of rows): the collectives that
        follow (mode "cast": the tile-local scales' SUM all-reduce or the batched master
        cast; both modes: FSDP2's all-gather of the bytes) are sized by them, and ranks that
        disagree would enter them with other sizes or not at all. One small all-reduce, at
        the first all-gather of the mode (its weights are fixed once found)."""
        if mode in self.agreed:
            return
        entries = self.entries(mode)
        if entries:
            layout = [(tuple(state.shape), repr(state.recipe), str(state.model_dtype),
                       str(local_of(fp).planes[0].dtype), chunk)
                      for state, fp, start, count, chunk in entries]
            comm = self.comm(entries[0][1])
            agreement = all_agree(comm, [len(layout), fingerprint(*layout)],
                                  reduce_max=comm.meta_all_reduce_max)
            if not agreement.same():
                raise ValueError(
                    f"FSDP2 FP8 weights (mode {mode!r}): the ranks hold different converted "
                    f"weights ({agreement.low[0]} to {agreement.high[0]} weights; this rank, "
                    f"rank {comm.rank}: {[shape for shape, *_ in layout]}); every rank must "
                    f"build the same model")
        self.agreed.add(mode)

    def ensure_cast(self, state):
        """Mode "cast", in the pre-all-gather hook (which reaches it through the registry:
        ``weights`` cannot import ``cast``, which imports ``weights`` through ``models``):
        re-cast every weight of the model when this one's parameter changed since its bytes
        were cast (every rank decides alike: the optimizer's in-place update bumps the
        version of every rank's shard).
        Two counts tell: the sharded parameter's version (the optimizer, ``load_state_dict``)
        and the state's count of plain-tensor copies into a shard (torch.distributed.
        checkpoint's load writes the local shards past the DTensor)."""
        hit = state.fsdp if state.fsdp is not None else self.fsdp_of(state)
        if state.frags is None or state.cast_version != cast_version(state, hit[0]):
            recast(self)

    def local_values(self, state, row_bytes):
        """Mode "primary": fp32 values of this rank's rows of `state`'s weight, given their
        rowwise FP8 bytes (on any device: the scales' device computes them); the rows start
        at this rank's FSDP2 shard (row 0 when FSDP2 does not manage the weight)."""
        rows, cols = state.shape
        if state.shard_place is not None:  # (a deep copy of the state keeps it)
            r0, count = state.shard_place
        else:
            found = self.fsdp_of(state)
            r0, count = shard_place(found[0], rows, cols)[:2] if found else (0, rows * cols)
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
            from ...comm import TorchComm

            hit = self._comms[id(pg)] = (pg, TorchComm(pg))
        return hit[1]

    def process_group(self, fsdp_param):
        """The torch process group the weight is sharded over."""
        return fsdp_param.mesh_info.shard_process_group


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


__all__ = ["Registry", "registries_of", "conversions_changed", "gathered_bytes", "cast_all",
           "cast_item", "recast", "cast_version"]
