"""The unsharded FP8 weight FSDP2 builds after each all-gather (both modes):
:class:`Float8BlockWeight`, a BlockTensor over FSDP's gather outputs, handed to the Linear
without requantizing (docs/torch.md, "FSDP2 with FP8 weights")."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ... import _arrays
from ...formats import Block2D
from ...layout import all_layouts
from ...tensor import BlockTensor, from_internal, internal_buffers

aten = torch.ops.aten


class _GatheredBlockTensor(BlockTensor):
    """A BlockTensor whose torch-side buffers are the very torch tensors it was built from
    (FSDP's all-gather outputs and fp8blk's scale tensors), not DLPack re-exports of its
    internal arrays. A Linear that saves these buffers for its backward pass thus saves
    views of FSDP's storage, which FSDP refills in place when it re-gathers for the backward
    pass (a DLPack export would keep a raw pointer to memory FSDP freed after forward).

    Needs only the public internal door ``internal_buffers``; the buffer-to-torch map holds
    (internal array, torch tensor) pairs per slot, used while the slot still holds that
    array."""

    __slots__ = ("_torch",)

    @classmethod
    def empty(cls, shape, recipe, dtype):
        self = from_internal(tuple(shape), recipe, [None, None, None, None], dtype,
                             _arrays.TORCH, cls)
        self._torch = [None, None, None, None]
        return self

    def _out(self, i):
        pair = self._torch[i]
        if pair is not None and internal_buffers(self)[i] is pair[0]:
            return pair[1]
        return super()._out(i)


class GatheredBox:
    """The gathered weight's storage, shared by the unsharded parameter and its aliases:
    the BlockTensor, the torch tensors behind its buffers, and a cache of their internal
    (NumPy/CuPy) arrays keyed by address, so a re-gather into the same memory re-imports
    nothing (a DLPack import is costly on the GPU). The scale tensors (the global scales,
    and the Block2D columnwise copy's) are never reallocated: imported once, here."""

    def __init__(self, state, dtype):
        self.state = state
        self.dtype = dtype
        rows, cols = state.shape
        recipe = state.recipe
        lay = all_layouts(recipe, rows, cols)
        self.block2d = isinstance(recipe, Block2D)
        self.col_data = None
        col_sinv = state.scales[1]
        if self.block2d:
            dev = state.scales[0].device
            # reused across iterations; its storage is FSDP's to free and re-allocate
            self.col_data = torch.empty(lay[2].shape, dtype=torch.uint8, device=dev)
            col_sinv = torch.empty(lay[3].shape, dtype=torch.float32, device=dev)
        self._internal = {}
        self.q = _GatheredBlockTensor.empty(state.shape, recipe,
                                            _arrays.numpy_dtype(state.model_dtype))
        self.row_sinv = self._import("row_sinv", state.scales[0], 1)
        self.col_sinv = self._import("col_sinv", col_sinv, 3)

    def inner_tensors(self):
        return [self.col_data] if self.col_data is not None else []

    def _import(self, key, t, slot):
        """Internal array of torch tensor `t` for BlockTensor slot `slot` (re-imported only
        when its address or shape changed), registered as that slot's torch view."""
        hit = self._internal.get(key)
        sig = (t.data_ptr(), tuple(t.shape), t.dtype)
        if hit is None or hit[0] != sig:
            # NumPy on the CPU; on the GPU the torch tensor itself (torch-native buffers)
            hit = self._internal[key] = (sig, _arrays.to_internal(t)[0])
        self.q._torch[slot] = (hit[1], t)
        return hit[1]

    def update(self, outputs, planes, usage):
        """Point the BlockTensor at freshly gathered planes; make or drop the columnwise
        copy as `usage` = (rowwise, columnwise) says."""
        rows = self.state.shape[0]
        bufs = internal_buffers(self.q)
        bufs[0] = bufs[1] = bufs[2] = bufs[3] = None
        for name, t in zip(planes, outputs):
            if t.shape[0] != rows:  # FSDP padded the weight to world x chunk rows
                t = t[:rows]
            if name == "row":
                bufs[0], bufs[1] = self._import("row", t, 0), self.row_sinv
            else:
                bufs[2], bufs[3] = self._import("col", t, 2), self.col_sinv
        if self.block2d:
            rowwise, columnwise = usage
            if columnwise:
                self._make_columnwise()
            elif self.col_data.untyped_storage().nbytes():
                self.col_data.untyped_storage().resize_(0)  # not needed in this pass
            if not rowwise:
                bufs[0] = bufs[1] = None  # only the transpose is needed: release rowwise

    def _make_columnwise(self):
        """Block2D: FP8 transpose of the gathered rowwise bytes into the reused buffers."""
        storage = self.col_data.untyped_storage()
        need = self.col_data.numel()
        if storage.nbytes() != need:
            storage.resize_(need)
        bufs = internal_buffers(self.q)
        bufs[2], bufs[3] = self._import("col", self.col_data, 2), self.col_sinv
        self.q.create_columnwise()

    def block_tensor(self, rowwise=True, columnwise=False):
        q = self.q
        if columnwise and not q.has_columnwise:
            if not isinstance(self.state.recipe, Block2D):
                raise RuntimeError(
                    "this MXFP8 weight was gathered without its columnwise plane (FSDP gathers "
                    "the planes the pass needs: rowwise in forward, columnwise in backward "
                    "when reshard_after_forward=True); MXFP8 columnwise data cannot be derived "
                    "from rowwise data")
            if not q.has_rowwise:
                raise RuntimeError("the gathered weight holds no data (it was resharded)")
            self._make_columnwise()
        if rowwise and not q.has_rowwise:
            if not isinstance(self.state.recipe, Block2D):
                raise RuntimeError(
                    "this MXFP8 weight was gathered for the backward pass (columnwise plane "
                    "only); its rowwise data is not here")
            q.update_usage(rowwise=True)
        return q


class Float8BlockWeight(torch.Tensor):
    """The unsharded FP8 weight FSDP2 builds after the all-gather (both modes).

    ``fp8blk_block_tensor(rowwise, columnwise)`` returns the :class:`fp8blk.BlockTensor`
    (Block2D or MXFP8, family torch) without requantizing; a Block2D columnwise copy not yet
    made is made by FP8 transpose. Any other torch op sees the dequantized weight (a plain
    tensor of the nominal dtype)."""

    @staticmethod
    def __new__(cls, box, requires_grad=False):
        state = box.state
        return torch.Tensor._make_wrapper_subclass(
            cls, state.shape, dtype=box.dtype, device=state.scales[0].device,
            requires_grad=requires_grad)

    def __init__(self, box, requires_grad=False):
        self._box = box

    def __repr__(self):
        return f"Float8BlockWeight(shape={tuple(self.shape)}, {self._box.q!r})"

    def regathered(self, outputs, planes, usage) -> None:
        """FSDP2's later gathers: the box repoints its BlockTensor at the new outputs."""
        self._box.update(outputs, planes, usage)

    def fp8blk_block_tensor(self, rowwise: bool = True, columnwise: bool = False):
        return self._box.block_tensor(rowwise, columnwise)

    def dequantize(self) -> torch.Tensor:
        q = self._box.q
        return q.dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return cls(args[0]._box)
        if func in (aten.as_strided.default, aten.view.default, aten._unsafe_view.default):
            src, size = args[0], tuple(args[1])
            if size == tuple(src.shape) and (func is not aten.as_strided.default or (
                    tuple(args[2]) == tuple(src.stride()) and (len(args) < 4 or not args[3]))):
                return cls(src._box)
        if func._schema.is_mutable and args and isinstance(args[0], Float8BlockWeight):
            raise NotImplementedError(f"Float8BlockWeight is read-only ({func})")
        a = tree_map_only(Float8BlockWeight, lambda t: t.dequantize(), args)
        k = tree_map_only(Float8BlockWeight, lambda t: t.dequantize(), kwargs)
        return func(*a, **k)


__all__ = ["Float8BlockWeight", "GatheredBox"]
