"""The all-to-alls of expert parallelism: :func:`quantized_all_to_all` (the dispatch: rows
quantized 1x128 before they travel, received as fp8blk's rowwise Block1D buffers, the same
bytes as quantizing the received rows) and :func:`high_precision_all_to_all` (the combine:
bf16 / fp32 rows back). Both take rows grouped by destination with per-destination counts and
check every rank's arguments in the call's one metadata collective (``fp8blk.comm.alltoall``).
docs/distributed.md ("All-to-all") specifies them; ``wire`` holds the scale wire.
"""
from __future__ import annotations

from ... import _arrays
from ...formats import Block1D, recipe_kind
from ...layout import all_layouts
from ...ops import quantize_into
from ...tensor import BlockTensor, from_internal, internal_buffers
from ..alltoall import HIGH_PRECISION, QUANTIZED, Call, byte_counts, dtype_code, exchange_counts
from ..base import Communicator, xp_of
from .wire import decode_scales, encode_scales, scale_blocks, wire_scale_bytes

_HIGH = frozenset(_arrays.HIGH_PRECISION)


def quantized_all_to_all(x, comm, send_counts, recipe=None, recv_counts=None, out=None,
                         async_op=False):
    """Send rows of ``x`` (N, K) to the ranks, quantized 1x128 (rowwise Block1D).

    ``x``: float32 / bfloat16 / float16 (NumPy, CuPy or torch), its rows grouped by
    destination: the first ``send_counts[0]`` rows go to rank 0, the next ``send_counts[1]``
    to rank 1, ... ``recipe``: a Block1D (default ``Block1D()``, power-of-two scales: one byte
    per scale on the wire). ``recv_counts``: the rows each rank sends here, if known (checked
    on every rank); otherwise learned in the call's one metadata collective. ``out``: a
    BlockTensor of the result's shape, recipe and dtype, holding rowwise buffers, to write into.

    Returns ``(q, recv_counts, handle)``: ``q`` a BlockTensor (R, K), R = sum(recv_counts), of
    x's dtype and family holding the rowwise data (R, K) uint8 and scale_inv (cdiv(K, 128),
    round4(R)) fp32, rows grouped by source rank, byte for byte ``fb.quantize(received rows,
    recipe)``; ``handle`` None, or with ``async_op`` a Handle to wait() on before ``q`` is read.

    >>> import numpy as np, fp8blk as fb
    >>> from mpi4py import MPI
    >>> comm = fb.comm.MPIComm(MPI.COMM_WORLD)
    >>> x = np.ones((2 * comm.size, 256), np.float32)
    >>> q, counts, _ = fb.comm.quantized_all_to_all(x, comm, [2] * comm.size)
    >>> q.shape == (2 * comm.size, 256) and counts == [2] * comm.size
    True
    """
    _check_comm(comm)
    recipe = Block1D() if recipe is None else recipe
    error = arr = None
    try:
        arr, family, dtype, out_bufs = _checked(x, recipe, out)
    except Exception as caught:  # every rank must learn of it, or its peers would wait
        error = caught
    if error is not None:
        call = Call(QUANTIZED, -1, -1, 0)
    else:
        call = Call(QUANTIZED, arr.shape[1], dtype_code(dtype), arr.shape[0], recipe,
                    -1 if out is None else out.shape[0])
    send, recv = exchange_counts(comm, call, send_counts, recv_counts, error)
    xp = xp_of(arr)
    n, k = arr.shape
    layouts = all_layouts(recipe, n, k)
    data = xp.empty(layouts[0].shape, layouts[0].dtype)
    scale_inv = xp.empty(layouts[1].shape, layouts[1].dtype)
    quantize_into(arr, recipe, True, False, dtype, [data, scale_inv, None, None])
    wire = encode_scales(xp, scale_inv, n, recipe)
    received = sum(recv)
    if out_bufs is None:
        got = all_layouts(recipe, received, k)
        out_bufs = [xp.empty(got[0].shape, got[0].dtype), xp.empty(got[1].shape, got[1].dtype)]
    wire_row = scale_blocks(k) * wire_scale_bytes(recipe)
    wire_in = xp.empty((received, wire_row), dtype=wire.dtype)
    parts = [(data.reshape(-1), byte_counts(send, k), out_bufs[0].reshape(-1),
              byte_counts(recv, k)),
             (wire.reshape(-1), byte_counts(send, wire_row), wire_in.reshape(-1),
              byte_counts(recv, wire_row))]
    handle = comm.all_to_all_parts(parts, "quantized_all_to_all", async_op)
    if out is None:
        buffers = [_public(b, family) for b in out_bufs] + [None, None]
        out = from_internal((received, k), recipe, buffers, dtype, family)

    def post(keep=(data, wire)):  # keep: the send buffers live until the exchange is done
        decode_scales(xp, wire_in, received, scale_blocks(k), recipe, out_bufs[1])
        return out
    if async_op:
        return out, recv, handle.then(post)
    handle.wait()
    post()
    return out, recv, None


def high_precision_all_to_all(y, comm, send_counts, recv_counts=None, out=None,
                              async_op=False):
    """The combine: rows of ``y`` (N, K) float32 / bfloat16 / float16 sent as they are,
    grouped by destination as in :func:`quantized_all_to_all`, with the same counts and
    checks. Returns ``(rows received (R, K) in y's dtype and family, recv_counts, handle)``
    (``handle`` None unless ``async_op``; then wait() on it before reading the rows)."""
    _check_comm(comm)
    error = None
    try:
        arr, _, dtype = _arrays.to_backend(y)
        _check_rows(arr, dtype, "high_precision_all_to_all")
    except Exception as caught:
        error = caught
    result, recv, out = comm.rows_all_to_all(y, send_counts, recv_counts, out, async_op,
                                             HIGH_PRECISION, error, "high_precision_all_to_all")
    return out, recv, (result if async_op else None)


def _check_comm(comm):
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an fp8blk communicator (MPIComm, NCCLComm, "
                        f"TorchComm), got {type(comm).__name__}")


def _check_rows(arr, dtype, what):
    if arr.ndim != 2:
        raise ValueError(f"{what} takes rows (N, K): a 2-D array, got shape "
                         f"{tuple(arr.shape)}")
    if dtype not in _HIGH:
        raise TypeError(f"{what} takes float32, bfloat16 or float16 rows, got {dtype}")


def _checked(x, recipe, out):
    """(internal contiguous (N, K) array, family, logical dtype, out's internal rowwise
    [data, scale_inv] or None) after this rank's own checks."""
    if recipe_kind(recipe) != "Block1D":
        raise TypeError(f"quantized_all_to_all quantizes 1x128 rowwise: recipe must be a "
                        f"fp8blk.Block1D(...), got {recipe!r}")
    arr, family, dtype = _arrays.to_backend(x)
    _check_rows(arr, dtype, "quantized_all_to_all")
    arr = xp_of(arr).ascontiguousarray(arr)
    if out is None:
        return arr, family, dtype, None
    if not isinstance(out, BlockTensor):
        raise TypeError(f"out must be a BlockTensor, got {type(out).__name__}")
    if out.recipe != recipe or out.dtype != dtype or len(out.shape) != 2 \
            or out.shape[1] != arr.shape[1] or not out.has_rowwise:
        raise ValueError(f"out must be a BlockTensor (R, {arr.shape[1]}) of {recipe!r} and "
                         f"dtype {dtype} holding rowwise data, got {out!r}")
    bufs = [_arrays.to_backend(b)[0] for b in internal_buffers(out)[:2]]
    return arr, family, dtype, bufs


def _public(buf, family):
    """An output buffer as a BlockTensor of ``family`` holds it (torch CUDA: a tensor)."""
    if family == _arrays.TORCH and _arrays.is_device(buf):
        return _arrays.from_backend(buf, family)
    return buf


__all__ = ["quantized_all_to_all", "high_precision_all_to_all"]
