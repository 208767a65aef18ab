"""The batched master cast both modes run: ``fp8blk.master.cast_batch`` over the converted
weights of one model, one all-reduce per recipe bucket for all weights, the bytes written
into each rank's own rows (mode "primary": the FP8 planes; mode "cast": the fragments the
all-gather sends). Each weight's ``master.Item`` is kept while its tensors stay where they
are.

An entry is ``(state, FSDPParam, first flat index, element count, chunk rows)``: this rank's
shard of one weight (``registry.Registry.entries``).
"""
from __future__ import annotations

import torch

from ... import _arrays, master
from ...formats import MXFP8


def _flat_array(t):
    """The flat internal (NumPy / CuPy) array of torch tensor `t` (None if empty)."""
    if t is None or t.numel() == 0:
        return None
    return _arrays.to_backend(t.detach().reshape(-1))[0]


def cast_item(j, entry, key, sources, *args):
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


__all__ = ["cast_item", "cast_all", "on_torch_stream"]
