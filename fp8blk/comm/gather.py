"""Quantized all-gather along dim 0 (DESIGN §5): ``gather_along_first_dim``.

Rank r holds x_r of shape (d_r, *rest) (the same ``rest`` everywhere; viewed as (m_r, K) with
m_r = d_r * prod(rest[:-1])). The result is the tensor of shape (sum d_r, *rest) that
``fb.quantize(concatenate(x_0, ..., x_{n-1}), recipe, rowwise, columnwise)`` returns, byte for
byte, on every rank.

Paths (``comm.stats.last_gather_path`` / ``comm.stats.gather_paths`` record which one ran):

``"fast"``      each rank quantizes its shard (or takes the BlockTensor it was given), and the
                FP8 bytes and valid scales of all ranks move in ONE all_gather_v; each rank's
                parts are then put in place: rows of (M, K) data, columns of the Block1D
                rowwise scales (cdiv(K,128), round4(M)) and of Block1D columnwise data (K, M),
                block-rows of the other scales; scale padding is rewritten (1.0 fp32, 0 E8M0).
                Block2D gathers rowwise only and derives columnwise by FP8 transpose.
``"fallback"``  where a shard cannot be quantized on its own: a block would cross a rank
                boundary (Block1D columnwise or any Block2D with a non-empty rank whose first
                row is not a multiple of 128; MXFP8 columnwise with a local row count that is
                not a multiple of 32), or a BlockTensor input lacks a direction its recipe
                cannot derive. The high-precision data is gathered (dequantized first, to the
                BlockTensor's own dtype, for BlockTensor inputs) and quantized after the
                gather. The result is the same; the traffic is 2-4x larger. A
                GatherFallbackWarning is issued once per call site.
``"plain"``     no recipe and an array input: a plain all-gather along dim 0 (any dtype).

Rowwise-only Block1D is always fast (its 1x128 blocks never cross rows), as is rowwise-only
MXFP8 from high-precision input (a shard whose row count is not a multiple of 32 is padded with
zero rows before its local quantize; the pad rows are not sent).

Before any data moves, the ranks exchange a few int64 of metadata (counted as ``meta_calls``):
shapes, dtype, recipe and usage must agree on every rank (else every rank raises the same
ValueError); a rank whose input is invalid makes every rank raise, so no rank is left waiting.

Inputs may be strided: array inputs are copied to C-contiguous first. The returned BlockTensor
(or array) is in the input's array family (NumPy, CuPy or torch) and on its device.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np

from .. import _arrays
from ..formats import MXFP8, Block1D, Block2D, check_recipe
from ..ops import quantize
from ..tensor import BlockTensor
from ..layout import all_layouts as buffer_layouts, cdiv as _cdiv, round_up as _round_up
from .base import xp_of
from .packed import byte_layout, fingerprint, meta_scope, pack_bytes

FAST, FALLBACK, PLAIN = "fast", "fallback", "plain"
ROW, COL = "rowwise", "columnwise"


class GatherFallbackWarning(UserWarning):
    """gather_along_first_dim gathered high-precision data because the FP8 shards could not
    be gathered as they are (same result, more traffic)."""


_warned_sites = set()


def _warn_once(site, message):
    if site in _warned_sites:
        return
    _warned_sites.add(site)
    warnings.warn_explicit(message, GatherFallbackWarning, site[0], site[1])


class _Part:
    """One buffer's contribution of a rank with m rows starting at global row o.

    ``shape(m, k)``: what is sent; ``local(buf, m, k)``: that region of the local buffer;
    ``place(G, o, m, k)``: where it lands in the global buffer G.
    """

    def __init__(self, index, shape, local, place):
        self.index, self.shape, self.local, self.place = index, shape, local, place


def _rows(index):
    # (m, K) row-major data: the rank's rows, in order
    return _Part(index, lambda m, k: (m, k), lambda b, m, k: b[:m],
                 lambda g, o, m, k: g[o: o + m])


def _parts(recipe, direction):
    if isinstance(recipe, Block1D) and direction == ROW:
        return [_rows(0),
                _Part(1, lambda m, k: (_cdiv(k, 128), m), lambda b, m, k: b[:, :m],
                      lambda g, o, m, k: g[:, o: o + m])]
    if isinstance(recipe, Block1D):
        return [_Part(2, lambda m, k: (k, m), lambda b, m, k: b,
                      lambda g, o, m, k: g[:, o: o + m]),
                _Part(3, lambda m, k: (_cdiv(m, 128), k), lambda b, m, k: b[:_cdiv(m, 128), :k],
                      lambda g, o, m, k: g[o // 128: o // 128 + _cdiv(m, 128), :k])]
    if isinstance(recipe, Block2D):  # rowwise only; columnwise is derived after the gather
        return [_rows(0),
                _Part(1, lambda m, k: (_cdiv(m, 128), _cdiv(k, 128)),
                      lambda b, m, k: b[:_cdiv(m, 128), :_cdiv(k, 128)],
                      lambda g, o, m, k: g[o // 128: o // 128 + _cdiv(m, 128), :_cdiv(k, 128)])]
    if direction == ROW:
        return [_rows(0),
                _Part(1, lambda m, k: (m, k // 32), lambda b, m, k: b[:m, :k // 32],
                      lambda g, o, m, k: g[o: o + m, :k // 32])]
    return [_rows(2),
            _Part(3, lambda m, k: (m // 32, k), lambda b, m, k: b[:m // 32, :k],
                  lambda g, o, m, k: g[o // 32: o // 32 + m // 32, :k])]


def _part_nbytes(recipe, part, m, k):
    itemsize = buffer_layouts(recipe, 0, 0)[part.index][1].itemsize
    return int(np.prod(part.shape(m, k), dtype=np.int64)) * itemsize


# --------------------------------------------------------------------------------------------
# The local input, validated before anything is exchanged


class _Source:
    """What this rank holds: an array (kind 0) or a BlockTensor (kind 1), as internal arrays."""

    def __init__(self, x, recipe, rowwise, columnwise):
        self.rowwise, self.columnwise = bool(rowwise), bool(columnwise)
        if isinstance(x, BlockTensor):
            self._from_block_tensor(x, recipe)
        else:
            self._from_array(x, recipe)
        self.dim0 = self.shape[0]
        self.k = self.shape[-1]
        self.inner = int(np.prod(self.shape[1:-1], dtype=np.int64))
        self.m = self.dim0 * self.inner
        if self.recipe is not None:
            if not (self.rowwise or self.columnwise):
                raise ValueError("gather_along_first_dim needs rowwise=True or "
                                 "columnwise=True (or both) when quantizing")
            if len(self.shape) < 2:
                raise ValueError(f"gather_along_first_dim with a recipe needs an input of at "
                                 f"least two dims (..., K), got shape {self.shape}: gathering "
                                 f"a 1-D input along dim 0 would change K")
        if self.kind == 1:
            self._check_buffers()

    def _from_array(self, x, recipe):
        self.kind = 0
        arr, self.family, self.dtype = _arrays.to_backend(x)
        if arr.ndim == 0:
            raise ValueError("gather_along_first_dim needs an array with at least one dim")
        self.xp = xp_of(arr)
        self.arr = self.xp.ascontiguousarray(arr)  # strided inputs are copied
        self.shape = tuple(int(d) for d in arr.shape)
        self.recipe = recipe
        self.buffers = None
        self.has_row = self.has_col = False
        if recipe is not None:
            check_recipe(recipe)
            if self.dtype not in _arrays.HIGH_PRECISION:
                raise TypeError(f"gather_along_first_dim quantizes float32, bfloat16 or "
                                f"float16 input, got {self.dtype}")

    def _from_block_tensor(self, x, recipe):
        self.kind = 1
        if recipe is not None and recipe != x.recipe:
            raise ValueError(f"x is a BlockTensor quantized with {x.recipe!r} but recipe="
                             f"{recipe!r} was given: pass recipe=None (or the same recipe), "
                             f"or dequantize x first to requantize it")
        public = (x.rowwise_data, x.rowwise_scale_inv, x.columnwise_data,
                  x.columnwise_scale_inv)
        held = [b for b in public if b is not None]
        if not held:
            raise ValueError("the BlockTensor holds neither rowwise nor columnwise data")
        self.family = _arrays.family_of(held[0])
        self.buffers = [None if b is None else _arrays.to_backend(b)[0] for b in public]
        self.xp = xp_of(next(b for b in self.buffers if b is not None))
        self.recipe = x.recipe
        self.dtype = np.dtype(x.dtype)
        self.shape = tuple(x.shape)
        self.arr = None
        self.block_tensor = x
        self.has_row = self.buffers[0] is not None
        self.has_col = self.buffers[2] is not None
        if self.dtype not in _arrays.HIGH_PRECISION:
            raise TypeError(f"the BlockTensor's dtype {self.dtype} is not float32, bfloat16 "
                            f"or float16")

    def _check_buffers(self):
        layouts = buffer_layouts(self.recipe, self.m, self.k)
        for i, (buf, (shape, dtype, _)) in enumerate(zip(self.buffers, layouts)):
            if buf is not None and (tuple(buf.shape) != shape or buf.dtype != dtype):
                name = ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                        "columnwise_scale_inv")[i]
                raise ValueError(f"the BlockTensor's {name} is {buf.dtype}{tuple(buf.shape)}, "
                                 f"expected {dtype}{shape} for shape {self.shape} and "
                                 f"{type(self.recipe).__name__}")

    @property
    def internal_family(self):
        return _arrays.CUPY if self.xp is not np else _arrays.NUMPY

    def caller_array(self, arr):
        """An internal array handed to fb.quantize in the caller's family (keeps bf16)."""
        return _arrays.from_backend(arr, self.family, self.dtype)

    def high_precision(self):
        """The local high-precision array (internal, C-contiguous)."""
        if self.kind == 0:
            return self.arr
        values = self.block_tensor.dequantize(dtype=self.dtype)  # its own dtype, not fp32
        return self.xp.ascontiguousarray(_arrays.to_backend(values)[0])


# --------------------------------------------------------------------------------------------
# Metadata exchange: every rank learns every rank's rows and checks that the rest agrees

_FIELDS = ("error", "dim0", "k", "shape", "dtype", "recipe", "kind", "has_row", "has_col",
           "rowwise", "columnwise")
_MUST_AGREE = {"shape": "the shape after dim 0", "dtype": "the dtype", "recipe": "the recipe",
               "kind": "the input kind (array or BlockTensor)",
               "rowwise": "rowwise=", "columnwise": "columnwise="}


def _describe(src):
    return (f"shape {src.shape}, dtype {src.dtype}, recipe {src.recipe!r}, "
            f"{'BlockTensor' if src.kind else 'array'}, rowwise={src.rowwise}, "
            f"columnwise={src.columnwise}")


def _exchange(comm, src, error):
    if error is not None:
        row = [1] + [0] * (len(_FIELDS) - 1)
    else:
        row = [0, src.dim0, src.k, fingerprint(src.shape[1:]), fingerprint(str(src.dtype)),
               fingerprint(repr(src.recipe)), src.kind, int(src.has_row), int(src.has_col),
               int(src.rowwise), int(src.columnwise)]
    local = np.array(row, dtype=np.int64)
    with meta_scope(comm):
        table = comm.all_gather(local)
    table = np.asarray(table).reshape(comm.size, len(_FIELDS))
    return {name: table[:, i] for i, name in enumerate(_FIELDS)}


def _validate(table, src, error):
    bad = [int(r) for r in np.flatnonzero(table["error"])]
    if bad:
        if error is not None:
            raise error
        raise ValueError(f"gather_along_first_dim: rank(s) {bad} rejected their input (see "
                         f"the error raised there); no data was exchanged")
    for field, what in _MUST_AGREE.items():
        column = table[field]
        if (column != column[0]).any():
            raise ValueError(f"gather_along_first_dim: ranks disagree on {what} (this rank: "
                             f"{_describe(src)}); every rank must pass the same")


# --------------------------------------------------------------------------------------------
# The plan: which path, and what moves


class _Plan:
    def __init__(self, src, table):
        self.dim0s = [int(d) for d in table["dim0"]]
        self.ms = [d * src.inner for d in self.dim0s]
        self.offsets = [int(o) for o in np.concatenate([[0], np.cumsum(self.ms)[:-1]])]
        self.M = sum(self.ms)
        self.K = src.k
        self.out_shape = (sum(self.dim0s),) + src.shape[1:]
        self.path, self.reason, self.directions = self._decide(src, table)

    def _aligned(self, block):
        return all(o % block == 0 for o, m in zip(self.offsets, self.ms) if m > 0)

    def _decide(self, src, table):
        recipe = src.recipe
        if recipe is None:
            return PLAIN, None, []
        name = type(recipe).__name__
        wanted = [d for d, on in ((ROW, src.rowwise), (COL, src.columnwise)) if on]
        if isinstance(recipe, MXFP8) and (self.K % 32 or self.M % 32):
            raise ValueError(f"MXFP8 needs M and K to be multiples of 32; the gathered tensor "
                             f"is (M, K) = ({self.M}, {self.K}) (local rows {self.ms})")
        if src.kind == 1 and not isinstance(recipe, Block2D):
            for direction, column in ((ROW, "has_row"), (COL, "has_col")):
                lacking = [r for r, h in enumerate(table[column]) if not h]
                if direction in wanted and lacking:
                    return (FALLBACK, f"the BlockTensor on rank(s) {lacking} holds no "
                            f"{direction} data, which {name} cannot derive from the other "
                            f"direction", wanted)
        rows = f"local rows {self.ms}"
        if isinstance(recipe, Block1D) and COL in wanted and not self._aligned(128):
            return (FALLBACK, f"{name} columnwise 128x1 blocks would cross a rank boundary "
                    f"({rows}; every non-empty rank must start at a multiple of 128)", wanted)
        if isinstance(recipe, Block2D):
            if not self._aligned(128):
                return (FALLBACK, f"{name} 128x128 tiles would be cut at a rank boundary "
                        f"({rows}; every non-empty rank must start at a multiple of 128)",
                        wanted)
            return FAST, None, [ROW]
        if isinstance(recipe, MXFP8) and COL in wanted and any(m % 32 for m in self.ms):
            return (FALLBACK, f"{name} columnwise 32x1 blocks would cross a rank boundary "
                    f"({rows}; every rank needs a multiple of 32)", wanted)
        return FAST, None, wanted


# --------------------------------------------------------------------------------------------
# Paths


def _internal(block_tensor):
    return [None if b is None else _arrays.to_backend(b)[0]
            for b in (block_tensor.rowwise_data, block_tensor.rowwise_scale_inv,
                      block_tensor.columnwise_data, block_tensor.columnwise_scale_inv)]


def _alloc(xp, recipe, m, k, indices):
    out = [None] * 4
    for i, (shape, dtype, fill) in enumerate(buffer_layouts(recipe, m, k)):
        if i in indices:
            out[i] = xp.empty(shape, dtype) if fill is None else xp.full(shape, fill, dtype)
    return out


def _local_buffers(src, plan):
    """This rank's quantized buffers (internal arrays) for the fast path."""
    recipe = src.recipe
    if src.kind == 1:
        buffers = src.buffers
        if isinstance(recipe, Block2D) and buffers[0] is None:
            derived = BlockTensor(src.shape, recipe, None, None, buffers[2], buffers[3],
                                  dtype=src.dtype, family=src.internal_family)
            buffers = _internal(derived.update_usage(rowwise=True))
        return buffers
    x2d = src.arr.reshape(src.m, src.k)
    rowwise, columnwise = ROW in plan.directions, COL in plan.directions
    if isinstance(recipe, MXFP8) and src.m % 32:
        # rowwise only (columnwise would have taken the fallback): 1x32 blocks stay within a
        # row, so zero rows padded to a multiple of 32 change nothing in the rows we send.
        padded = src.xp.zeros((_round_up(src.m, 32), src.k), dtype=x2d.dtype)
        padded[: src.m] = x2d
        x2d = padded
    return _internal(quantize(src.caller_array(x2d), recipe, rowwise, columnwise))


def _fast(comm, src, plan):
    recipe, xp, k = src.recipe, src.xp, plan.K
    parts = [p for d in plan.directions for p in _parts(recipe, d)]
    local = _local_buffers(src, plan)
    send_parts = []
    for part in parts:
        view = part.local(local[part.index], src.m, k)
        assert tuple(view.shape) == part.shape(src.m, k), (part.index, view.shape)
        send_parts.append(xp.ascontiguousarray(view))
    counts = [byte_layout([_part_nbytes(recipe, p, m, k) for p in parts])[1] for m in plan.ms]
    send = pack_bytes(xp, send_parts, counts[comm.rank])
    recv = xp.empty(sum(counts), dtype=np.uint8)
    gathered = _alloc(xp, recipe, plan.M, k, {p.index for p in parts})
    derive_columnwise = isinstance(recipe, Block2D) and src.columnwise
    if derive_columnwise:
        gathered[2:] = _alloc(xp, recipe, plan.M, k, {2, 3})[2:]
    handle = comm.all_gather_v(send, counts, out=recv, async_op=True)
    layouts = buffer_layouts(recipe, 0, 0)

    def unpack():
        base = 0
        for r, (m, offset) in enumerate(zip(plan.ms, plan.offsets)):
            positions, _ = byte_layout([_part_nbytes(recipe, p, m, k) for p in parts])
            for part, position in zip(parts, positions):
                nbytes = _part_nbytes(recipe, part, m, k)
                chunk = recv[base + position: base + position + nbytes]
                chunk = chunk.view(layouts[part.index][1]).reshape(part.shape(m, k))
                part.place(gathered[part.index], offset, m, k)[...] = chunk
            base += counts[r]
        if derive_columnwise:
            full = BlockTensor(plan.out_shape, recipe, *gathered, dtype=src.dtype,
                               family=src.internal_family)
            derived = _internal(full.create_columnwise())
            for i in (2, 3):
                if derived[i] is not gathered[i]:
                    gathered[i][...] = derived[i]
    final = list(gathered)
    if isinstance(recipe, Block2D) and not src.rowwise:
        final[0] = final[1] = None
    out = BlockTensor(plan.out_shape, recipe, *final, dtype=src.dtype, family=src.family)
    return out, handle.then(unpack)


def _gather_high_precision(comm, src, plan):
    """(full internal high-precision array of out_shape, handle)."""
    local = src.high_precision()
    full = src.xp.empty(plan.out_shape, dtype=local.dtype)
    counts = [d * src.inner * src.k for d in plan.dim0s]
    handle = comm.all_gather_v(local.reshape(-1), counts, out=full.reshape(-1), async_op=True)
    return full, handle


def _fallback(comm, src, plan, async_op):
    full, handle = _gather_high_precision(comm, src, plan)
    rowwise, columnwise = src.rowwise, src.columnwise

    def quantize_full():
        return quantize(src.caller_array(full), src.recipe, rowwise, columnwise)
    if not async_op:
        handle.wait()
        return quantize_full(), None
    indices = {i for i, on in ((0, rowwise), (1, rowwise), (2, columnwise), (3, columnwise))
               if on}
    buffers = _alloc(src.xp, src.recipe, plan.M, plan.K, indices)
    out = BlockTensor(plan.out_shape, src.recipe, *buffers, dtype=src.dtype, family=src.family)

    def fill():
        for target, value in zip(buffers, _internal(quantize_full())):
            if target is not None:
                target[...] = value
    return out, handle.then(fill)


def gather_along_first_dim(x, comm, recipe=None, rowwise=True, columnwise=False,
                           async_op=False):
    """All-gather ``x`` along dim 0 over ``comm``, quantized.

    ``x``: a high-precision array (..., K) (NumPy, CuPy or torch; float32/bfloat16/float16
    when quantizing, any dtype without a recipe) or a :class:`fp8blk.BlockTensor`.
    ``recipe``: the recipe to quantize with (None: a BlockTensor keeps its own; an array is
    gathered as it is). ``rowwise`` / ``columnwise``: the usages the result holds.

    Returns ``(out, handle)``: ``out`` is the BlockTensor (or array) of shape
    (sum of the ranks' dim 0, *x.shape[1:]); ``handle`` is None, or with ``async_op`` a
    Handle whose ``wait()`` must be called before ``out`` is read (it fills ``out`` and
    returns it). See the module docstring for the paths and their guarantees.
    """
    frame = sys._getframe(1)
    site = (frame.f_code.co_filename, frame.f_lineno)
    for attribute in ("rank", "size", "all_gather", "all_gather_v"):
        if not hasattr(comm, attribute):
            raise TypeError(f"comm must be an fp8blk communicator (MPIComm, NCCLComm, "
                            f"TorchComm), got {type(comm).__name__}")
    try:
        src, error = _Source(x, recipe, rowwise, columnwise), None
    except Exception as caught:  # every rank must learn of it, or its peers would wait
        src, error = None, caught
    table = _exchange(comm, src, error)
    _validate(table, src, error)
    plan = _Plan(src, table)
    stats = getattr(comm, "stats", None)
    if stats is not None and hasattr(stats, "record_gather_path"):
        stats.record_gather_path(plan.path)

    if plan.path == PLAIN:
        full, handle = _gather_high_precision(comm, src, plan)
        out = _arrays.from_backend(full, src.family, src.dtype)
        handle = handle.then(lambda: out)
    elif plan.path == FAST:
        out, handle = _fast(comm, src, plan)
        handle = handle.then(lambda: out)
    else:
        _warn_once(site, f"gather_along_first_dim: {plan.reason}; gathering "
                         f"{src.dtype} data and quantizing after the gather (the same bytes, "
                         f"more traffic)")
        out, handle = _fallback(comm, src, plan, async_op)
        if handle is None:
            return out, None
        handle = handle.then(lambda: out)
    if async_op:
        return out, handle
    handle.wait()
    return out, None


__all__ = ["gather_along_first_dim", "GatherFallbackWarning", "FAST",
           "FALLBACK", "PLAIN"]
