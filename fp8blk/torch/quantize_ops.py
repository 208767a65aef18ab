"""fp8blk's quantize and Block2D transpose as torch custom ops (``torch.ops.fp8blk.*``), so
``torch.compile(fullgraph=True)`` traces a Float8BlockLinear without graph breaks.

Quantized tensors travel between ops as 4 plain tensors ``(rowwise_data, rowwise_scale_inv,
columnwise_data, columnwise_scale_inv)`` in fp8blk's layouts (``fp8blk/layout.py``,
docs/layouts.md); a direction not held is an empty tensor of shape (0,). Recipes travel as strings
(``fp8blk.formats.recipe_key``), since custom ops take no Python objects.

    import torch, fp8blk as fb
    from fp8blk.torch.quantize_ops import quantize_buffers
    x = torch.randn(256, 384)
    rd, rs, cd, cs = quantize_buffers(x, fb.Block1D(), rowwise=True, columnwise=True)
"""
from __future__ import annotations

import torch

from .. import _arrays
from ..formats import recipe_from_key, recipe_key
from ..layout import all_layouts
from ..ops import quantize_buffers as _ops_quantize_buffers
from ..tensor import BlockTensor

_EMPTIES = {}


def _empty(device, fresh=True):
    if fresh:
        return torch.empty((0,), dtype=torch.uint8, device=device)
    hit = _EMPTIES.get(device)     # one shared placeholder per device: host time on CUDA
    if hit is None:
        hit = _EMPTIES[device] = torch.empty((0,), dtype=torch.uint8, device=device)
    return hit


def block_tensor_buffers(q: BlockTensor, fresh: bool = False):
    """The 4 buffers of a BlockTensor as torch tensors (empty (0,) tensors where absent;
    ``fresh``: new ones, as a custom op's outputs must not alias each other)."""
    return _four((q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data,
                  q.columnwise_scale_inv), fresh)


def _four(bufs, fresh=False):
    """4 torch buffers, None (a direction not held) as an empty (0,) tensor."""
    if bufs[0] is not None and bufs[2] is not None:
        return tuple(bufs)
    device = (bufs[0] if bufs[0] is not None else bufs[2]).device
    return tuple(_empty(device, fresh) if b is None else b for b in bufs)


def block_tensor_from_buffers(shape, recipe, buffers, dtype) -> BlockTensor:
    """A BlockTensor (torch family) over the given torch buffers, without copies; empty
    buffers mean "direction not held". ``dtype`` is the torch dtype that was quantized."""
    internal = [None if b.dim() == 1 and b.numel() == 0 else _arrays.to_internal(b)[0]
                for b in buffers]
    return BlockTensor(shape, recipe, *internal, dtype=_arrays.numpy_dtype(dtype),
                       family=_arrays.TORCH)


@torch.library.custom_op("fp8blk::quantize", mutates_args=())
def _quantize(x: torch.Tensor, recipe: str, rowwise: bool, columnwise: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # outputs must not alias each other or the input; fp8blk allocates fresh buffers
    return _four(_ops_quantize_buffers(x, recipe_from_key(recipe), rowwise, columnwise),
                 fresh=True)


@_quantize.register_fake
def _quantize_fake(x, recipe, rowwise, columnwise):
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    layouts = all_layouts(recipe_from_key(recipe), rows, x.shape[-1])
    out = []
    for i, lay in enumerate(layouts):
        held = rowwise if i < 2 else columnwise
        out.append(x.new_empty(lay.shape if held else (0,),
                               dtype=_arrays.numpy_to_torch_dtype(lay.dtype) if held
                               else torch.uint8))
    return tuple(out)


def _block2d_transpose_impl(data, scale_inv, recipe):
    rows, cols = data.shape
    q = block_tensor_from_buffers((rows, cols), recipe,
                                  (data, scale_inv, _empty(data.device), _empty(data.device)),
                                  torch.float32)
    q.create_columnwise()
    return q.columnwise_data, q.columnwise_scale_inv


@torch.library.custom_op("fp8blk::block2d_transpose", mutates_args=())
def _block2d_transpose(data: torch.Tensor, scale_inv: torch.Tensor, recipe: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return _block2d_transpose_impl(data, scale_inv, recipe_from_key(recipe))


@_block2d_transpose.register_fake
def _block2d_transpose_fake(data, scale_inv, recipe):
    rows, cols = data.shape
    lay = all_layouts(recipe_from_key(recipe), rows, cols)
    return (data.new_empty(lay[2].shape, dtype=torch.uint8),
            data.new_empty(lay[3].shape, dtype=torch.float32))


# In eager mode the functions below call the implementations directly: a Python custom op's
# dispatch costs tens of microseconds of host time per call, which the hot path does not need.
# Under torch.compile they go through the ops, which dynamo and the fake implementations trace.
_compiling = torch.compiler.is_compiling


def quantize_buffers(x2d: torch.Tensor, recipe, rowwise: bool, columnwise: bool):
    """``fb.quantize(x2d, recipe, rowwise, columnwise)``: 4 tensors (see module docstring)."""
    if _compiling():
        return torch.ops.fp8blk.quantize(x2d, recipe_key(recipe), rowwise, columnwise)
    return _four(_ops_quantize_buffers(x2d, recipe, rowwise, columnwise))


def block2d_columnwise(data: torch.Tensor, scale_inv: torch.Tensor, recipe):
    """Block2D columnwise buffers (K, M) data and scale_inv from the rowwise (M, K) ones, by
    FP8 transpose (``BlockTensor.create_columnwise``, no requantization)."""
    if _compiling():
        return torch.ops.fp8blk.block2d_transpose(data, scale_inv, recipe_key(recipe))
    return _block2d_transpose_impl(data, scale_inv, recipe)


def mxfp8_columnwise_as_rows(data: torch.Tensor, scale_inv: torch.Tensor):
    """MXFP8 columnwise (M, K) data with 32x1 blocks and scales (round4(M/32), round128(K))
    re-laid as the rowwise buffers of the transpose: (K, M) data with 1x32 blocks and scales
    (round128(K), round4(M/32)). Copies both (MXFP8's columnwise layout is not transposed,
    docs/layouts.md): a documented cost of the MXFP8 option."""
    return data.t().contiguous(), scale_inv.t().contiguous()


__all__ = ["quantize_buffers", "block2d_columnwise",
           "mxfp8_columnwise_as_rows", "block_tensor_buffers", "block_tensor_from_buffers"]
