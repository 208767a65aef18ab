"""Packed collectives: many small arrays in one flat buffer, one collective, results written
back (all-reduce) or unpacked (all-gather). N tensors cost one call's latency instead of N.

Layout checks: with ``check=True`` (the default) each call first all-reduces a 32-byte
fingerprint of its layout (element counts, shapes, dtype, op) with MAX, counted as metadata in
``comm.stats`` (``meta_calls``), not as data. If any rank disagrees, every rank raises the same
ValueError instead of entering a mismatched collective, which in MPI or NCCL would hang or
silently mix buffers. Pass ``check=False`` where the layout is known to agree (e.g. after a
first checked step) to issue exactly one collective.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ..layout import round_up
from .agree import all_agree, fingerprint
from .base import byte_view, check_op, nbytes_of, xp_of

ALIGN = 16  # bytes: every packed part starts on this boundary, so typed views stay aligned


def check_layout(comm, what: str, count: int, layout_fingerprint: int, describe: str):
    """Raise ValueError on every rank unless all ranks pass the same count and fingerprint
    (one probe of :mod:`fp8blk.comm.agree`: a 32-byte MAX all-reduce, counted as metadata)."""
    agreement = all_agree(comm, [count, layout_fingerprint])
    if not agreement.same(0):
        raise ValueError(f"{what}: ranks disagree on the number of packed elements (from "
                         f"{agreement.low[0]} to {agreement.high[0]}; this rank: {describe}); "
                         f"every rank must pass arrays of the same sizes, in the same order")
    if not agreement.same(1):
        raise ValueError(f"{what}: ranks agree on the element count ({count}) but not on the "
                         f"layout (shapes, dtype or op; this rank: {describe}); every rank "
                         f"must pass the same shapes, dtype and op")


def byte_layout(nbytes_list):
    """(offsets, total): each part starts on an ALIGN-byte boundary; total is a multiple of
    ALIGN."""
    offsets, total = [], 0
    for nbytes in nbytes_list:
        offsets.append(total)
        total += round_up(int(nbytes), ALIGN)
    return offsets, total


def pack_bytes(xp, parts, total=None):
    """One flat uint8 buffer holding the C-contiguous internal arrays ``parts`` at the
    offsets of :func:`byte_layout` (padding bytes are zero)."""
    offsets, needed = byte_layout([nbytes_of(p) for p in parts])
    flat = xp.zeros(needed if total is None else total, dtype=np.uint8)
    for part, offset in zip(parts, offsets):
        flat[offset: offset + nbytes_of(part)] = byte_view(part)
    return flat


def _internals(arrays, what):
    if isinstance(arrays, (np.ndarray,)) or not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{what} takes a list or tuple of arrays, got {type(arrays).__name__}")
    converted = [_arrays.to_backend(a) for a in arrays]
    families = {family for _, family, _ in converted}
    devices = {_arrays.is_device(arr) for arr, _, _ in converted}
    if len(families) > 1 or len(devices) > 1:
        raise TypeError(f"{what}: all arrays must be of one array family on one kind of "
                        f"device; got families {sorted(families)}")
    return converted


def _describe(internals):
    sizes = [int(a.size) for a, _, _ in internals]
    dtypes = sorted({str(d) for _, _, d in internals})
    return f"{sum(sizes)} elements in {len(sizes)} arrays of {'/'.join(dtypes) or '-'}"


def packed_all_reduce(comm, arrays, op="sum", check=True, async_op=False, dtype=None):
    """All-reduce every array of ``arrays`` with ``op`` ("sum" or "max") in ONE collective.

    ``arrays``: a list of arrays of one dtype and family (NumPy, CuPy or torch; any shapes,
    strided views allowed), the same sizes in the same order on every rank. They are packed
    into one flat buffer, reduced, and the results are written back into the given arrays.
    Returns ``arrays``, or with ``async_op`` a Handle whose ``wait()`` writes them back and
    returns them. With ``check`` a layout mismatch across ranks raises ValueError on every
    rank (see the module docstring). ``dtype`` reinterprets integer storage, as in
    ``Communicator.all_reduce`` (CuPy uint16 arrays holding bfloat16: ``dtype="bfloat16"``).
    """
    what = "packed_all_reduce"
    check_op(op)
    internals = _internals(arrays, what)
    dtypes = {d for _, _, d in internals}
    if len(dtypes) > 1:
        raise TypeError(f"{what} packs arrays of one dtype; got {sorted(map(str, dtypes))}: "
                        f"call it once per dtype")
    logical = dtypes.pop() if dtypes else np.dtype(np.float32)
    dtype = logical if dtype is None else _arrays.numpy_dtype(dtype)
    sizes = tuple(int(a.size) for a, _, _ in internals)
    if check:
        check_layout(comm, what, sum(sizes), fingerprint(what, str(dtype), op, sizes),
                     _describe(internals))
    xp = xp_of(internals[0][0]) if internals else np
    storage = internals[0][0].dtype if internals else logical
    flat = xp.empty(sum(sizes), dtype=storage)
    offset = 0
    for (arr, _, _), size in zip(internals, sizes):
        flat[offset: offset + size] = arr.reshape(-1)
        offset += size

    def unpack():
        position = 0
        for (arr, _, _), size in zip(internals, sizes):
            arr[...] = flat[position: position + size].reshape(arr.shape)
            position += size
        return arrays
    handle = comm.all_reduce(flat, op=op, async_op=True, dtype=dtype)
    result = handle.then(unpack)
    if async_op:
        return result
    return result.wait()


def packed_all_gather(comm, arrays, check=True, async_op=False):
    """All-gather every array along dim 0 in ONE collective.

    ``arrays``: a list of arrays (n_i, ...) of any dtypes (FP8 bytes, scales, ...), one array
    family, the same shapes on every rank. Returns the list of gathered arrays (size*n_i, ...),
    in the same family, or with ``async_op`` a Handle whose ``wait()`` returns it. The bytes
    move as one uint8 buffer, so dtypes a backend cannot gather (float8 on gloo) are fine.
    """
    what = "packed_all_gather"
    internals = _internals(arrays, what)
    for arr, _, _ in internals:
        if arr.ndim == 0:
            raise ValueError(f"{what}: arrays need at least one dimension (gathered along "
                             f"dim 0)")
    shapes = tuple(tuple(int(d) for d in a.shape) for a, _, _ in internals)
    if check:
        nbytes = sum(nbytes_of(a) for a, _, _ in internals)
        check_layout(comm, what, nbytes,
                     fingerprint(what, shapes, tuple(str(d) for _, _, d in internals)),
                     _describe(internals))
    xp = xp_of(internals[0][0]) if internals else np
    parts = [xp.ascontiguousarray(a) for a, _, _ in internals]
    offsets, total = byte_layout([nbytes_of(p) for p in parts])
    send = pack_bytes(xp, parts, total)
    recv = xp.empty(total * comm.size, dtype=np.uint8)
    outs = [xp.empty((comm.size * p.shape[0],) + tuple(p.shape[1:]), dtype=p.dtype)
            for p in parts]

    def unpack():
        for part, offset, out in zip(parts, offsets, outs):
            nbytes = nbytes_of(part)
            for r in range(comm.size):
                chunk = recv[r * total + offset: r * total + offset + nbytes]
                out[r * part.shape[0]: (r + 1) * part.shape[0]] = \
                    chunk.view(part.dtype).reshape(part.shape)
        return [_arrays.from_backend(out, family, dtype)
                for out, (_, family, dtype) in zip(outs, internals)]
    handle = comm.all_gather(send, out=recv, async_op=True)
    result = handle.then(unpack)
    if async_op:
        return result
    return result.wait()


__all__ = ["packed_all_reduce", "packed_all_gather", "check_layout", "byte_layout",
           "pack_bytes"]
