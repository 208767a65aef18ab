"""The communicator protocol every backend implements (``Communicator``: rank, size,
all_reduce, all_gather, all_gather_v, reduce_scatter, broadcast, barrier, all_to_all_v), the
Handle of an asynchronous collective, and the traffic counters (``Stats``). MPIComm, NCCLComm
and TorchComm subclass ``Communicator``. The specification (arrays, dtypes, ``op="max"`` on NaN and -0.0,
ordering rules, counters) is docs/distributed.md, "The communicator protocol".
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from .. import _arrays
from .alltoall import PLAIN, Call, byte_counts, dtype_code, exchange_counts

OPS = ("sum", "max")
# dtypes the reductions support (all_gather / broadcast move bytes and take any dtype)
REDUCE_DTYPES = tuple(np.dtype(d) for d in (np.uint8, np.int32, np.int64, np.float16,
                                             np.float32, np.float64)) + (_arrays.BF16,)


class Stats:
    """Cumulative traffic counters of one communicator; fields are described in the module
    docstring. Attribute access (``stats.calls``) and item access (``stats["calls"]``) both
    work."""

    _FIELDS = ("calls", "bytes", "meta_calls", "meta_bytes")
    _added = {}  # name -> (zero, export) of the counters features added

    def __init__(self):
        self.reset()

    @classmethod
    def add_counter(cls, name: str, zero, export=None):
        """A counter of a feature built on the communicators: attribute ``name`` of every
        Stats, ``zero()`` after each reset, ``export(value)`` (default: the value) in
        :meth:`as_dict`. The feature updates the attribute itself."""
        cls._added[name] = (zero, export)

    def reset(self):
        self.calls = 0
        self.bytes = 0
        self.meta_calls = 0
        self.meta_bytes = 0
        self.ops = {}
        for name, (zero, _) in self._added.items():
            setattr(self, name, zero())

    def record(self, op: str, nbytes: int, meta: bool = False):
        if meta:
            self.meta_calls += 1
            self.meta_bytes += int(nbytes)
            return
        self.calls += 1
        self.bytes += int(nbytes)
        entry = self.ops.setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += int(nbytes)

    def __getitem__(self, name):
        return getattr(self, name)

    def as_dict(self) -> dict:
        result = {"calls": self.calls, "bytes": self.bytes, "meta_calls": self.meta_calls,
                  "meta_bytes": self.meta_bytes,
                  "ops": {k: list(v) for k, v in self.ops.items()}}
        for name, (_, export) in self._added.items():
            value = getattr(self, name)
            result[name] = value if export is None else export(value)
        return result

    def __repr__(self):
        return f"Stats({self.as_dict()})"


class Handle:
    """An operation in flight. ``wait()`` blocks until it is complete (for device backends:
    makes the caller's current stream wait for it), then runs the post-processing once, and
    returns the result; calling it again returns the same result and does nothing else.

    ``waiter``: called once to complete the communication (None: already complete).
    ``post``:   called once after it; a non-None return value replaces ``result``.
    """

    __slots__ = ("_waiter", "_post", "result", "_state", "_error")

    def __init__(self, waiter=None, post=None, result=None):
        self._waiter = waiter
        self._post = post
        self.result = result
        self._state = 0  # 0 pending, 1 done, 2 failed
        self._error = None

    @classmethod
    def completed(cls, result=None) -> "Handle":
        return cls(result=result)

    @property
    def done(self) -> bool:
        return self._state != 0

    def wait(self):
        if self._state == 1:
            return self.result
        if self._state == 2:
            raise self._error
        # Mark the state before running anything, so that a failure is not retried (a second
        # MPI wait on a freed request, or post-processing applied twice, would be wrong).
        waiter, post = self._waiter, self._post
        self._waiter = self._post = None
        try:
            if waiter is not None:
                waiter()
            if post is not None:
                value = post()
                if value is not None:
                    self.result = value
        except BaseException as error:
            self._state, self._error = 2, error
            raise
        self._state = 1
        return self.result

    def then(self, post) -> "Handle":
        """A Handle that waits for this one, then runs ``post()`` (whose non-None return value
        becomes its result; otherwise it forwards this handle's result)."""
        def chained():
            value = post()
            return self.result if value is None else value
        return Handle(waiter=self.wait, post=chained, result=self.result)

    def __repr__(self):
        return f"Handle({'done' if self.done else 'pending'})"


def check_op(op) -> str:
    if op not in OPS:
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    return op


def xp_of(arr):
    """numpy or cupy, for an internal array."""
    if _arrays.is_device(arr):
        import cupy

        return cupy
    return np


def nbytes_of(arr) -> int:
    return int(arr.size) * arr.dtype.itemsize


def byte_view(arr):
    """Flat uint8 view of a C-contiguous internal array."""
    return arr.reshape(-1).view(np.uint8)


# --------------------------------------------------------------------------------------------
# NaN-ignoring MAX through integer keys (for backends whose float MAX is not fmax)

_KEY_TYPES = {2: np.int16, 4: np.int32, 8: np.int64}


def torch_gather_out(torch, inp, out, size):
    """For an all_gather that hands torch tensors to the library as they are: the output
    tensor (``out``, or a new one when None) if ``inp`` is a contiguous torch tensor with at
    least one dim and ``out`` is None or a contiguous tensor of shape (size * n, ...) with
    inp's dtype and device; else None (the general path)."""
    if type(inp) is not torch.Tensor or inp.dim() == 0 or not inp.is_contiguous():
        return None
    shape = (size * inp.shape[0],) + tuple(inp.shape[1:])
    if out is None:
        return inp.new_empty(shape)
    if (type(out) is not torch.Tensor or out.dtype != inp.dtype or out.device != inp.device
            or tuple(out.shape) != shape or not out.is_contiguous()):
        return None
    return out


def float_to_max_keys(arr, dtype):
    """Turn a float host array into signed integer keys, in place (returns the integer view).

    Keys order like the floats (-0.0 just below +0.0), and every NaN gets the smallest
    integer, which no number has; integer MAX over keys is then fmax over the floats.
    """
    itype = np.dtype(_KEY_TYPES[np.dtype(dtype).itemsize])
    values = arr.view(dtype)
    nan = np.isnan(values)
    keys = arr.view(itype)
    # Negative floats (sign bit set, so negative as integers): flip the magnitude bits, so a
    # larger magnitude gives a smaller key. The map is its own inverse.
    mask = itype.type(np.iinfo(itype).max)
    np.bitwise_xor(keys, mask, out=keys, where=keys < 0)
    keys[nan] = np.iinfo(itype).min
    return keys


def max_keys_to_float(keys):
    """Undo :func:`float_to_max_keys` in place (the smallest key becomes a NaN)."""
    mask = keys.dtype.type(np.iinfo(keys.dtype).max)
    np.bitwise_xor(keys, mask, out=keys, where=keys < 0)


def is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype == _arrays.BF16 or dtype.kind == "f"


# --------------------------------------------------------------------------------------------
# The base class: argument handling and counting; backends implement the underscored hooks


class Communicator:
    """Base class of the backends; see the module docstring for the protocol.

    Backends implement, on internal (NumPy / CuPy), C-contiguous arrays, each returning a
    :class:`Handle` (``Handle.completed()`` when done synchronously):
    ``_all_reduce(buf, dtype, op, async_op)``, ``_all_gather(inp, out, async_op)``,
    ``_all_gather_v(inp, counts, out, async_op)`` (optional: the default pads to the largest
    count and uses ``_all_gather``), ``_reduce_scatter(inp, out, dtype, op, async_op)``,
    ``_broadcast(buf, root, async_op)``, ``_barrier()``, ``_all_to_all_v(parts, async_op)``
    (see :meth:`all_to_all_parts`). ``inp`` / ``buf`` of all_gather,
    all_gather_v and broadcast arrive as flat uint8 views; reductions keep their dtype.

    Package-internal operations the quantized gather (``fp8blk.comm.gather``) builds on, not
    part of the user protocol (defaults here; backends override for speed):
    ``record(op, nbytes)`` (count a collective issued outside the public methods),
    ``gather_parts(items, stream_ptr)`` (one grouped, possibly in-place all-gather of several
    byte buffers; NCCL: one group, MPI: in-place Iallgather(v), torch: one
    all_gather_into_tensor of the parts packed), ``gather_parts_issuer(items)`` (the same as
    a callable of the stream, for items issued again and again), ``meta_all_gather(row)`` /
    ``meta_all_reduce_max(row)`` (small host int64 metadata, never staged through a device),
    ``stream_ordered`` (whether ``gather_parts`` only enqueues on a stream),
    ``orders_torch_stream`` (whether the backend orders against torch's current stream).
    """

    rank: int = 0
    size: int = 1
    #: the quantized gather's plan cache of this communicator (``fp8blk.comm.gather``'s
    #: ``PlanCache``), None until its first gather
    gather_state = None

    def __init__(self):
        self.stats = Stats()
        self._meta_depth = 0

    # -- counters -----------------------------------------------------------------------------
    def reset_stats(self):
        self.stats.reset()

    @contextlib.contextmanager
    def metadata(self):
        """Collectives issued inside count as metadata (``meta_calls``/``meta_bytes``), not
        as data: used by fp8blk's helpers for layout checks and size exchanges."""
        self._meta_depth += 1
        try:
            yield self
        finally:
            self._meta_depth -= 1

    def record(self, op, nbytes):
        """Count one collective of ``nbytes`` in ``stats`` (as metadata inside
        :meth:`metadata`)."""
        self.stats.record(op, nbytes, meta=self._meta_depth > 0)

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    # -- public collectives ----------------------------------------------------------------
    def all_reduce(self, buf, op="sum", async_op=False, dtype=None):
        check_op(op)
        arr, family, logical = _arrays.to_backend(buf)
        dtype = _reduce_dtype(arr, logical, dtype)
        _require_contiguous(arr, "all_reduce buffer")
        self.record("all_reduce", nbytes_of(arr))
        handle = self._all_reduce(arr, dtype, op, async_op)
        return _finish(handle, async_op, buf)

    def all_gather(self, inp, out=None, async_op=False):
        arr, family, logical = _arrays.to_backend(inp)
        if arr.ndim == 0:
            raise ValueError("all_gather needs an array with at least one dimension (it "
                             "concatenates along dim 0)")
        xp = xp_of(arr)
        arr = xp.ascontiguousarray(arr)
        out_shape = (self.size * arr.shape[0],) + tuple(arr.shape[1:])
        out, out_arr = _output(out, out_shape, arr, family, logical, "all_gather")
        self.record("all_gather", nbytes_of(arr))
        handle = self._all_gather(byte_view(arr), byte_view(out_arr), async_op)
        return _finish(handle, async_op, out, sync_result=out)

    def all_gather_v(self, inp, counts, out=None, async_op=False):
        counts = [int(c) for c in counts]
        if len(counts) != self.size or min(counts, default=0) < 0:
            raise ValueError(f"all_gather_v needs one non-negative count per rank "
                             f"({self.size}), got {counts}")
        arr, family, logical = _arrays.to_backend(inp)
        xp = xp_of(arr)
        arr = xp.ascontiguousarray(arr).reshape(-1)
        if arr.size != counts[self.rank]:
            raise ValueError(f"all_gather_v: this rank's input has {arr.size} elements but "
                             f"counts[{self.rank}] is {counts[self.rank]}")
        out, out_arr = _output(out, (sum(counts),), arr, family, logical, "all_gather_v",
                               flat_ok=True)
        item = arr.dtype.itemsize
        byte_counts = [c * item for c in counts]
        self.record("all_gather_v", self._all_gather_v_wire_bytes(byte_counts))
        handle = self._all_gather_v(byte_view(arr), byte_counts, byte_view(out_arr), async_op)
        return _finish(handle, async_op, out, sync_result=out)

    def reduce_scatter(self, inp, out=None, op="sum", async_op=False, dtype=None):
        check_op(op)
        arr, family, logical = _arrays.to_backend(inp)
        dtype = _reduce_dtype(arr, logical, dtype)
        if arr.ndim == 0 or arr.shape[0] % self.size:
            raise ValueError(f"reduce_scatter needs dim 0 divisible by the group size "
                             f"{self.size}, got shape {tuple(arr.shape)}")
        xp = xp_of(arr)
        arr = xp.ascontiguousarray(arr)
        out_shape = (arr.shape[0] // self.size,) + tuple(arr.shape[1:])
        out, out_arr = _output(out, out_shape, arr, family, logical, "reduce_scatter")
        self.record("reduce_scatter", nbytes_of(arr))
        handle = self._reduce_scatter(arr, out_arr, dtype, op, async_op)
        return _finish(handle, async_op, out, sync_result=out)

    def broadcast(self, buf, root=0, async_op=False):
        if not (isinstance(root, (int, np.integer)) and 0 <= root < self.size):
            raise ValueError(f"broadcast root must be a rank in [0, {self.size}), got {root!r}")
        arr, family, logical = _arrays.to_backend(buf)
        _require_contiguous(arr, "broadcast buffer")
        self.record("broadcast", nbytes_of(arr))
        handle = self._broadcast(byte_view(arr), int(root), async_op)
        return _finish(handle, async_op, buf)

    def barrier(self):
        self.stats.record("barrier", 0, meta=True)
        self._barrier()

    def all_to_all_v(self, inp, send_counts, recv_counts=None, out=None, async_op=False):
        """Rows (dim 0) of ``inp``, grouped by destination: the first ``send_counts[0]`` go to
        rank 0, the next ``send_counts[1]`` to rank 1, ...; returns the rows received, grouped
        by source, of shape (sum of recv counts, *inp.shape[1:]). ``recv_counts``: the rows
        each rank sends here, when the caller knows them (checked); otherwise learned in the
        call's one metadata collective (``fp8blk.comm.alltoall``). Bad counts, or ranks that
        disagree (row shape, dtype, a peer's count), raise on every rank before data moves.
        Returns the output (a Handle whose wait() returns it with ``async_op``)."""
        return self.rows_all_to_all(inp, send_counts, recv_counts, out, async_op)[0]

    def rows_all_to_all(self, inp, send_counts, recv_counts=None, out=None, async_op=False,
                        kind=PLAIN, local_error=None, op="all_to_all_v"):
        """:meth:`all_to_all_v` returning ``(output or Handle, recv counts, output)``;
        ``kind`` and ``local_error`` (the caller's own verdict on ``inp``, which its peers
        must learn) are for the features built on it (``fp8blk.comm.dispatch``).
        Package-internal."""
        arr = family = logical = None
        if local_error is None:
            try:
                arr, family, logical = _arrays.to_backend(inp)
                if arr.ndim == 0:
                    raise ValueError(f"{op} needs an array with at least one dimension "
                                     f"(rows are dim 0)")
                out_rows = _out_rows(out, arr, logical, op)
            except Exception as error:  # every rank must learn of it, or its peers would wait
                arr, local_error = None, error
        if arr is None:
            call = Call(kind, -1, -1, 0)
        else:
            width = int(np.prod(arr.shape[1:], dtype=np.int64))
            call = Call(kind, width, dtype_code(logical), arr.shape[0], out_rows=out_rows)
        send, recv = exchange_counts(self, call, send_counts, recv_counts, local_error)
        xp = xp_of(arr)
        arr = xp.ascontiguousarray(arr)
        out_shape = (sum(recv),) + tuple(arr.shape[1:])
        out, out_arr = _output(out, out_shape, arr, family, logical, op)
        row_bytes = call.width * arr.dtype.itemsize
        parts = [(byte_view(arr), byte_counts(send, row_bytes), byte_view(out_arr),
                  byte_counts(recv, row_bytes))]
        handle = self.all_to_all_parts(parts, op, async_op)
        return _finish(handle, async_op, out, sync_result=out), recv, out

    def all_to_all_parts(self, parts, op, async_op):
        """One all-to-all of several byte buffers that share their destinations, counted as
        ONE collective ``op`` of the bytes this rank sends. ``parts``: list of ``(send,
        send byte counts, recv, recv byte counts)``, flat uint8 internal arrays laid out peer
        by peer. Returns a Handle. Package-internal (the quantized all-to-all's data and
        scales travel as two parts)."""
        self.record(op, sum(sum(p[1]) for p in parts))
        return self._all_to_all_v(parts, async_op)

    # -- backend hooks --------------------------------------------------------------------------
    def _all_reduce(self, buf, dtype, op, async_op):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_gather(self, inp, out, async_op):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_gather_v_wire_bytes(self, byte_counts):
        """Bytes this rank sends in all_gather_v (the default pads to the largest count)."""
        return max(byte_counts, default=0)

    def _all_gather_v(self, inp, byte_counts, out, async_op):
        """Default: pad every rank's bytes to the largest count, all_gather, compact."""
        width = max(byte_counts, default=0)
        if all(c == width for c in byte_counts):
            return self._all_gather(inp, out, async_op)
        xp = xp_of(inp)
        padded = xp.zeros(width, dtype=np.uint8)
        padded[: inp.size] = inp
        staging = xp.empty(width * self.size, dtype=np.uint8)
        handle = self._all_gather(padded, staging, async_op)

        def compact():
            offset = 0
            for r, count in enumerate(byte_counts):
                out[offset: offset + count] = staging[r * width: r * width + count]
                offset += count
        return handle.then(compact)

    def _reduce_scatter(self, inp, out, dtype, op, async_op):  # pragma: no cover - abstract
        raise NotImplementedError

    def _broadcast(self, buf, root, async_op):  # pragma: no cover - abstract
        raise NotImplementedError

    def _barrier(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_to_all_v(self, parts, async_op):  # pragma: no cover - abstract
        raise NotImplementedError

    # -- package-internal operations of the quantized gather (fp8blk.comm.gather) -------------
    #: True for backends that order against torch's current stream (torch process groups):
    #: the gather makes its communication stream torch's current stream around them
    orders_torch_stream = False

    #: True when ``gather_parts`` enqueues on a device stream and its ``finish`` (if any)
    #: only orders that stream (never blocks the host): then the gather's post-processing is
    #: enqueued right away and an asynchronous gather's handle is an event.
    stream_ordered = False

    def meta_all_gather(self, row):
        """All-gather a small host int64 vector (metadata) into a (size, len) NumPy table,
        through host memory only (no device staging), counted as metadata."""
        table = np.empty((self.size, row.size), dtype=np.int64)
        with self.metadata():
            self.record("all_gather", nbytes_of(row))
            self._all_gather(byte_view(row), byte_view(table), False).wait()
        return table

    def meta_all_reduce_max(self, row):
        """In-place MAX all-reduce of a small host int64 vector, counted as metadata."""
        with self.metadata():
            self.record("all_reduce", nbytes_of(row))
            self._all_reduce(row, row.dtype, "max", False).wait()
        return row

    def gather_parts_issuer(self, items):
        """``issue(stream_ptr)``, the same as ``gather_parts(items, stream_ptr)``, for items
        that are issued again and again (the gather's steady state keeps it): backends work
        out their call arguments once where they can."""
        return functools.partial(self.gather_parts, items)

    def gather_parts(self, items, stream_ptr=None):
        """One grouped all-gather of several byte buffers (the quantized gather's data and
        scales), issued without Python post-processing where the backend allows.

        ``items``: list of ``(send, recv, counts)``: ``recv`` a flat uint8 array of
        ``sum(counts)`` bytes that receives rank r's bytes at offset ``sum(counts[:r])``;
        ``send`` a flat uint8 array of ``counts[rank]`` bytes, or None when this rank's bytes
        are already in place in ``recv``. Arrays are NumPy, CuPy or torch. ``stream_ptr``: the
        device stream to enqueue on (device backends). Returns None when complete (or, for
        stream-ordered backends, enqueued), else a ``finish()`` callable to run before the
        result is read. Default: one all_gather_v per item, copying in-place slots out."""
        handles = []
        for send, recv, counts in items:
            arr = _arrays.to_backend(recv)[0]
            if send is None:
                start = sum(counts[: self.rank])
                send_arr = arr[start: start + counts[self.rank]].copy()
            else:
                send_arr = _arrays.to_backend(send)[0]
            handles.append(self._all_gather_v(send_arr, list(counts), arr, True))

        def finish():
            for handle in handles:
                handle.wait()
        return finish


def _finish(handle, async_op, result, sync_result=None):
    """Public return value: a Handle whose wait() returns ``result`` when async, else the
    synchronous result (None for in-place collectives)."""
    if handle is None:
        handle = Handle.completed()
    outer = handle.then(lambda: result)
    if async_op:
        return outer
    outer.wait()
    return sync_result


def _reduce_dtype(arr, logical, dtype):
    dtype = logical if dtype is None else _arrays.numpy_dtype(dtype)
    if dtype != logical and not (dtype.itemsize == arr.dtype.itemsize
                                 and arr.dtype.kind in "ui"):
        raise TypeError(f"dtype={dtype} does not match the buffer's dtype {logical} (an "
                        f"explicit dtype only reinterprets integer bit patterns, e.g. CuPy "
                        f"uint16 holding bfloat16)")
    if dtype not in REDUCE_DTYPES:
        raise TypeError(f"reductions support {', '.join(str(d) for d in REDUCE_DTYPES)}; "
                        f"got {dtype}")
    return dtype


def _out_rows(out, like, logical, what):
    """Rows of a given ``out`` (-1 when None), after the checks that need no peer: dtype,
    trailing shape, contiguity (its rows are checked against the receive counts on every
    rank)."""
    if out is None:
        return -1
    out_arr, _, out_logical = _arrays.to_backend(out)
    if out_logical != logical:
        raise TypeError(f"{what}: out has dtype {out_logical}, the input {logical}")
    if out_arr.ndim != like.ndim or tuple(out_arr.shape[1:]) != tuple(like.shape[1:]):
        raise ValueError(f"{what}: out must have shape (received rows, "
                         f"*{tuple(like.shape[1:])}), got {tuple(out_arr.shape)}")
    _require_contiguous(out_arr, f"{what} output")
    return int(out_arr.shape[0])


def _require_contiguous(arr, what):
    if not arr.flags.c_contiguous:
        raise ValueError(f"the {what} must be C-contiguous (it is written in place); pass a "
                         f"contiguous array, e.g. numpy.ascontiguousarray(x) or x.contiguous(), "
                         f"and copy the result back")


def _output(out, shape, like, family, logical, what, flat_ok=False):
    """(out in the caller's family, internal out array) of ``shape``, allocated if None."""
    if out is None:
        xp = xp_of(like)
        out_arr = xp.empty(shape, dtype=like.dtype)
        return _arrays.from_backend(out_arr, family, logical), out_arr
    out_arr, _, out_logical = _arrays.to_backend(out)
    if out_arr.dtype != like.dtype:
        raise TypeError(f"{what}: out has dtype {out_logical}, the input {logical}")
    size = int(np.prod(shape, dtype=np.int64))
    if (tuple(out_arr.shape) != tuple(shape)) and not (flat_ok and out_arr.size == size):
        raise ValueError(f"{what}: out must have shape {tuple(shape)}, got "
                         f"{tuple(out_arr.shape)}")
    _require_contiguous(out_arr, f"{what} output")
    return out, out_arr
