"""The converted weights of one model (one ``prepare_fsdp_fp8`` call) and what they need from
FSDP2: its FSDPParam and parameter group per weight, this rank's shard of each, and a
TorchComm per shard process group. Each weight's :class:`~.weights.WeightState` points at
its registry, which is how the FSDP2 hooks reach the per-model work (the re-cast of mode
"cast", the values of mode "primary").
"""
from __future__ import annotations

import copy
import weakref

import numpy as np
import torch

from ... import reference, scaling
from ...comm.agree import all_agree, fingerprint
from ...formats import Block2D
from .cast import cast_version, recast
from .state import local_of, shard_place
from .weights import PlaneWeight


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


__all__ = ["Registry"]
