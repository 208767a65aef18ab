"""Mode "cast" (torchao's float8-FSDP pattern): the parameters stay high precision and the
optimizer updates them; once per step (:func:`precompute_fp8_scales`, or lazily at the first
all-gather after the parameters changed: :func:`recast` from ``Registry.ensure_cast``) the
global scales of all weights come from one packed all-reduce and each rank's rows are cast
into the FP8 fragments the all-gather sends.

Two casts: a Block2D weight whose shards hold whole 128-row tiles and whose parameter has
the model dtype is quantized tile by tile on its own rank, only its scales all-reduced (one
packed SUM); the others take the batched partial-amax master cast (``batch``).
"""
from __future__ import annotations

import torch

from ... import _arrays
from ...formats import Block2D
from ...layout import cdiv
from ...ops import quantize, quantize_into
from .batch import cast_all, cast_item
from .models import registries_of
from .state import local_of


def precompute_fp8_scales(model: torch.nn.Module) -> None:
    """Mode "cast": global tile scales of every converted weight of ``model`` from ONE packed
    partial-amax all-reduce (per recipe), and each rank's rows cast to FP8 with them, ready
    for the next all-gathers. Call after ``optimizer.step()`` on every rank (else it happens
    lazily at the first gather after the parameters changed)."""
    for reg in registries_of(model):
        recast(reg)


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
            q = quantize(x2d, state.recipe, rowwise=True)
            data.copy_(q.rowwise_data)
            sinv.copy_(q.rowwise_scale_inv)
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


__all__ = ["precompute_fp8_scales", "recast", "cast_version"]
