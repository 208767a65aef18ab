"""The rank agreement of ``cast_master_weights`` (on the probe of :mod:`fp8blk.comm.agree`):
when the ranks' batches disagree, or one rank's arguments are invalid, every rank raises the
same error -- no hang, no crash inside the collective library, no wrong bytes -- and the steady
state makes no collective of its own. The protocol: docs/distributed.md, "Rank agreement".
"""
from __future__ import annotations

import weakref

import numpy as np

from .._bounded import BoundedCache
from ..comm.agree import Agreement, fingerprint, metadata_scope, probe_row
from ..formats import Block2D, MXFP8, recipe_code, recipe_from_code
from .items import MODEL_DTYPES

# verified configs kept per communicator; least recently used first out: every rank looks up
# and inserts the same configs in the same order, so every rank evicts the same
_MAX_CONFIGS = 64


def _reduce_small(comm, arr):
    """MAX all-reduce of a small NumPy array as metadata; returns the reduced NumPy array. A
    communicator that takes device buffers only (NCCLComm built without a host communicator)
    gets a CuPy copy -- decided by the communicator alone, so every rank does the same."""
    device_only = type(comm).__name__ == "NCCLComm" and getattr(comm, "host_comm", 0) is None
    if device_only:
        import cupy

        arr = cupy.asarray(arr)
    with metadata_scope(comm):
        comm.all_reduce(arr, op="max")
    return _to_host(arr)


def local_batch(items, model_dtype, on_device):
    """This rank's :class:`LocalBatch` of validated items (fp8blk.master.items): per weight
    (h, w, recipe, rowwise, columnwise, start, count), empty shards as (0, 0)."""
    weights = tuple([(it.h, it.w, it.recipe, it.rowwise, it.columnwise,
                      it.start if it.count else 0, it.count) for it in items])

    def first():
        """(on_device, unit dtype, entries) of the first bucket's packed buffer, or None."""
        for bucket_type, unit in ((Block2D, np.int32), (MXFP8, np.uint8)):
            bucket = [it for it in items if isinstance(it.recipe, bucket_type)]
            if bucket:
                return (on_device, np.dtype(unit),
                        sum(it.row_blocks + it.col_blocks for it in bucket))
        return None
    return LocalBatch(weights, MODEL_DTYPES.index(model_dtype), on_device, first)


class Diverted(Exception):
    """Raised inside the first bucket's all-reduce when the header says the ranks are not all
    in the predicted config: nothing has been written yet; the caller takes the branch."""


class LocalBatch:
    """This rank's view of a batch. ``key``: everything that must match the prediction for a
    hit; ``weights``: per weight (h, w, recipe, rowwise, columnwise, start, count);
    ``first``: callable giving the first bucket's (on_device, unit dtype, entries) or None."""

    __slots__ = ("key", "weights", "model_code", "on_device", "first")

    def __init__(self, weights, model_code, on_device, first):
        self.weights = weights
        self.model_code = model_code
        self.on_device = on_device
        self.key = (model_code, on_device, weights)
        self.first = first


class Config:
    """A verified batch: ``fp`` its fingerprint (the same on every rank), ``key`` this rank's
    key in it, ``first`` its first bucket's (on_device, unit, entries) or None."""

    __slots__ = ("fp", "key", "first", "_hit")

    def __init__(self, fp, key, first):
        self.fp, self.key, self.first, self._hit = fp, key, first, None

    def hit_header(self, device=False):
        """The header every rank sends when all hit -- also what they all get back -- encoded
        once (and, for device buffers, uploaded once)."""
        if self._hit is None:
            host = encode(self.first[1], False, False, self.fp)
            self._hit = (host, host.tobytes(), None)
        if device and self._hit[2] is None:
            import cupy

            self._hit = self._hit[:2] + (cupy.asarray(self._hit[0]),)
        return self._hit


class _State:
    def __init__(self):
        self.verified = BoundedCache(_MAX_CONFIGS, on_evict=self._forget)  # fp -> Config
        self.local = {}      # this rank's key -> fp of the latest verified config holding it
        self.successor = {}  # fp -> fp of the config that followed it last time
        self.last = None     # fp of the previous call's config; None after an error

    def predict(self):
        if self.last is None:
            return None
        return self.verified.get(self.successor.get(self.last, self.last))

    def remember(self, config):
        self.verified.put(config.fp, config)
        self.local[config.key] = config.fp

    def _forget(self, old, config):
        self.local = {k: v for k, v in self.local.items() if v != old}
        self.successor = {k: v for k, v in self.successor.items() if old not in (k, v)}

    def finish(self, fp):
        if self.last is not None:
            self.successor[self.last] = fp
        self.last = fp


_states = weakref.WeakKeyDictionary()


def _state(comm):
    try:
        state = _states.get(comm)
        if state is None:
            state = _states[comm] = _State()
        return state
    except TypeError:  # a communicator that cannot be weakly referenced: no memory
        return _State()


# --------------------------------------------------------------------------------------------
# The header: [error, miss, unknown, chunks of fp, mask - chunks], in the bucket's unit dtype


def _chunking(unit):
    bits = 8 if np.dtype(unit).itemsize == 1 else 16
    return bits, 64 // bits, (1 << bits) - 1


def header_size(unit) -> int:
    """Entries the header adds to the first bucket's buffer (11 int32, or 19 uint8)."""
    return 3 + 2 * _chunking(unit)[1]


def encode(unit, error, miss, fp):
    bits, n, mask = _chunking(unit)
    chunks = [((fp or 0) >> (bits * i)) & mask for i in range(n)]
    return np.array([int(error), int(miss), int(fp is None)] + probe_row(chunks, top=mask),
                    dtype=unit)


class Header:
    __slots__ = ("error", "miss", "unknown", "agree", "fp")

    def __init__(self, reduced):
        values = [int(v) for v in reduced[:3]]
        bits, n, mask = _chunking(reduced.dtype)
        chunks = Agreement(reduced[3:], top=mask)
        self.error, self.miss, self.unknown = values[0] > 0, values[1] > 0, values[2] > 0
        self.agree = chunks.same()
        self.fp = sum(c << (bits * i) for i, c in enumerate(chunks.high))

    @property
    def steady(self):
        return not (self.error or self.miss) and self.agree


def _to_host(arr):
    return arr if isinstance(arr, np.ndarray) else arr.get()  # CuPy: waits for the stream


class HeaderedComm:
    """Stands in for ``comm`` in the first bucket's all-reduce of a hit rank: reduces the packed
    buffer with the header appended, and raises :class:`Diverted` (before anything is
    written) unless every rank hit."""

    def __init__(self, comm, config):
        self.comm, self.config, self.result = comm, config, None

    def all_reduce(self, buf, op="max"):
        n = buf.size
        device = not isinstance(buf, np.ndarray)
        header, header_bytes, header_dev = self.config.hit_header(device)
        if device:
            import cupy as xp
        else:
            xp = np
        full = xp.empty(n + header.size, buf.dtype)
        full[:n] = buf
        full[n:] = header_dev if device else header
        self.comm.all_reduce(full, op="max")
        reduced = _to_host(full[n:])
        if reduced.tobytes() != header_bytes:  # all hit <=> the MAX is the hit header itself
            self.result = Header(reduced)
            raise Diverted()
        buf[...] = full[:n]


def _zeros_with_header(comm, first, header):
    """A miss/error rank's part of the first collective: the predicted layout, all zeros (the
    identity of MAX) but the header."""
    on_device, unit, entries = first
    if on_device:
        import cupy as xp
    else:
        xp = np
    full = xp.zeros(entries + header.size, unit)
    full[entries:] = xp.asarray(header)
    with metadata_scope(comm):  # no data of this rank's moves (hit ranks count it as their data)
        comm.all_reduce(full, op="max")
    return Header(_to_host(full[entries:]))


# --------------------------------------------------------------------------------------------
# The call


def run(comm, batch, error, cast):
    """One ``cast_master_weights`` call on a communicator of size > 1. ``batch`` is this rank's
    LocalBatch (None when ``error``, its validation error, is set); ``cast(first_comm)`` runs
    the buckets, using ``first_comm`` (or ``comm`` when None) for the first bucket's
    all-reduce."""
    state = _state(comm)
    predicted = state.predict()
    hit = error is None and predicted is not None and batch.key == predicted.key
    if hit:
        believed = predicted.fp
    else:
        believed = None if error is not None else state.local.get(batch.key)
    try:
        if hit and predicted.first is not None:
            first_comm = HeaderedComm(comm, predicted)
            try:
                cast(first_comm)
                state.finish(predicted.fp)
                return
            except Diverted:
                result = first_comm.result
        elif predicted is not None and predicted.first is not None:
            header = encode(predicted.first[1], error is not None, True, believed)
            result = _zeros_with_header(comm, predicted.first, header)
        else:
            header = encode(np.int32, error is not None, not hit, believed)
            result = Header(_reduce_small(comm, header))
            if result.steady:  # every rank passed the predicted empty batch
                state.finish(predicted.fp)
                return
        if result.error:
            _raise_errors(comm, error)
        known = state.verified.get(result.fp) if result.agree and not result.unknown else None
        if known is not None:
            config = known  # every rank is in this known config
        else:
            config = _verify(comm, batch)
            state.remember(config)
        cast(None)
        state.finish(config.fp)
    except BaseException:
        state.last = None  # every rank raises here alike; a fresh start next call
        raise


def _raise_errors(comm, error):
    flags = np.zeros(comm.size, np.int64)
    flags[comm.rank] = error is not None
    flags = _reduce_small(comm, flags)
    if error is not None:
        raise error
    bad = [int(r) for r in np.flatnonzero(flags)]
    raise ValueError(f"cast_master_weights: rank(s) {bad} rejected their arguments (see the "
                     f"error raised there); nothing was written on any rank")


# --------------------------------------------------------------------------------------------
# Verification exchange (metadata; only when the batch or the shards change)

_MODEL_NAMES = ("float32", "bfloat16", "float16")


def _gather(comm, row):
    """Every rank's int64 row (values >= 0), through one MAX all-reduce (metadata)."""
    row = np.asarray(row, dtype=np.int64)
    table = np.zeros((comm.size,) + row.shape, np.int64)
    table[comm.rank] = row
    return _reduce_small(comm, table)


def _describe(fields):
    h, w, *code, row, col = (int(v) for v in fields)
    held = "+".join(d for d, on in (("rowwise", row), ("columnwise", col)) if on) or "none"
    return f"{h}x{w} {recipe_from_code(code)!r} holding {held}"


def _verify(comm, batch):
    """The exchange: ValueError on every rank alike, or the verified Config."""
    size = comm.size
    if batch is None:  # cannot happen: errors are raised before (kept as a guard)
        raise RuntimeError("cast_master_weights: verification without a batch")
    t1 = _gather(comm, [len(batch.weights), batch.model_code, int(batch.on_device)])
    counts, models, devices = t1[:, 0], t1[:, 1], t1[:, 2]
    per_rank = lambda col, fmt=str: ", ".join(f"rank {r}: {fmt(v)}" for r, v in enumerate(col))
    if (counts != counts[0]).any():
        raise ValueError(f"cast_master_weights: ranks disagree on the number of weights "
                         f"({per_rank(counts, int)}); every rank passes the same weights list, "
                         f"with a None master (or an empty shard) where it owns nothing")
    if (models != models[0]).any():
        raise ValueError(f"cast_master_weights: ranks disagree on model_dtype "
                         f"({per_rank(models, lambda m: _MODEL_NAMES[m])}); pass the same on "
                         f"every rank")
    if (devices != devices[0]).any():
        raise ValueError(f"cast_master_weights: ranks disagree on where the weights live "
                         f"({per_rank(devices, lambda d: 'device' if d else 'host')})")
    rows = []
    for h, w, recipe, row, col, start, count in batch.weights:
        rows.append([fingerprint(h, w, recipe_code(recipe), row, col), start, count])
    t2 = _gather(comm, np.array(rows, np.int64).reshape(len(rows), 3))
    for i in range(len(rows)):
        sigs = t2[:, i, 0]
        if (sigs != sigs[0]).any():
            h, w, recipe, row, col, _, _ = batch.weights[i]
            details = _gather(comm, [h, w] + recipe_code(recipe) + [int(row), int(col)])
            raise ValueError(f"cast_master_weights: ranks disagree on weights[{i}] "
                             f"({per_rank(details, _describe)}); every rank passes the same "
                             f"weights, in the same order, with the same recipe and directions")
    for i, (h, w, *_rest) in enumerate(batch.weights):
        _check_tiling(i, h, w, [(int(t2[r, i, 1]), int(t2[r, i, 2])) for r in range(size)])
    fp = fingerprint(t1.tobytes(), t2.tobytes())
    return Config(fp, batch.key, batch.first())


def _check_tiling(index, h, w, ranges):
    """The non-empty shards [o, o+n) of all ranks must cover [0, h*w) once."""
    total = h * w
    spans = sorted((o, o + n, r) for r, (o, n) in enumerate(ranges) if n > 0)
    listing = ", ".join(f"rank {r}: [{o}, {o + n})" for r, (o, n) in enumerate(ranges))
    position = 0
    for start, end, rank in spans:
        if start > position:
            raise ValueError(f"cast_master_weights: the shards of weights[{index}] ({h}x{w}, "
                             f"{total} elements) leave [{position}, {start}) uncovered "
                             f"({listing}); every element must be owned by exactly one rank")
        if start < position:
            raise ValueError(f"cast_master_weights: the shards of weights[{index}] ({h}x{w}) "
                             f"overlap on [{start}, {min(position, end)}) ({listing}); every "
                             f"element must be owned by exactly one rank")
        position = end
    if position < total:
        raise ValueError(f"cast_master_weights: the shards of weights[{index}] ({h}x{w}, "
                         f"{total} elements) leave [{position}, {total}) uncovered "
                         f"({listing}); every element must be owned by exactly one rank")
