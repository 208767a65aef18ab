"""The master-weight kernels' launcher (the GPU side of ``fp8blk.master``; reference:
``fp8blk.reference.partial_amax`` / ``partial_cast``): the batch table of a recipe bucket (one
row per weight, :class:`BatchWeight`), the arena that addresses every array of the batch from
one base, and the launches of the partial-amax kernels (``_partial_amax_kernel``), the scale
and cast kernels (``_partial_cast_kernel``): a constant number per bucket, whatever its size.
How a bucket is cast: docs/distributed.md, "Master weights".
"""
from __future__ import annotations

import threading

import numpy as np

from .. import _arrays
from .._bounded import BoundedCache
from ..formats import Block2D, E4M3
from ..layout import cdiv, round_up
from . import _cache
from . import _specs as sp
from ._launch import Tuning, data_ptr, module_of
from ._specs import (AMAX2D_THREADS, CAST_CHUNK, CAST_THREADS, F_AMAX0, F_AMAXF0, F_BAND0,
                     F_CAST0, F_CASTF0, F_COLBUF, F_COLDATA, F_COLSINV, F_E4M3, F_EPS,
                     F_FASTROW0, F_FASTROW1, F_H, F_HASCOL, F_HASROW, F_MBF16, F_MOFF, F_MVEC,
                     F_N, F_NCB, F_NFC, F_O, F_POW2, F_ROWBUF, F_ROWDATA, F_ROWSINV, F_SCALE0,
                     F_VEC2D, F_W, MX_COLS, MXAMAX_THREADS, NF, SCALE_THREADS, SIM)

# Batch table: every weight of a bucket is one row of an int64 table (fields F_* of _specs),
# uploaded once (cached while the shards and buffers stay where they are). A launch covers a
# contiguous range of rows; each CUDA block finds its weight by binary search over a prefix
# field (its first block), so 100 weights cost one launch, not 100. Rows hold offsets, not
# pointers: all arrays of a batch are addressed from one base (:class:`Arena`); on the GPU the
# lowest of their addresses rounded down to 256 bytes, through typed raw-pointer parameters
# (mem32 / mem16 / mem8 / memf, the same base); under the simulator the arrays are copied into
# one NumPy pool at offsets that keep their alignment modulo 16, and written ones copied back.


# ---- one weight ---------------------------------------------------------------------------------


class BatchWeight:
    """One weight of a bucket as the kernels read it. ``index``: its place in the caller's
    list (for messages); ``h``, ``w``: its logical (M, K) shape; ``recipe``: Block2D or MXFP8;
    ``master``: this rank's flat shard, an internal 1-D array (NumPy or CuPy) of ``count``
    elements starting at flat ``start`` of the row-major weight, or None (``count`` 0);
    ``master_dtype``: the shard's logical dtype (float32 or BF16; device bf16 arrays are
    uint16); ``rowwise`` / ``columnwise``: the directions the weight holds; ``frag_row`` /
    ``frag_col``: internal uint8 (count,) arrays the owned data bytes go to instead of the
    weight's data buffers, or None. :meth:`buffers` gives the weight's four internal arrays
    (rowwise data, rowwise scale_inv, columnwise data, columnwise scale_inv; None where not
    held), in the layouts of docs/layouts.md."""

    def __init__(self, index, h, w, recipe, master, master_dtype, start, count, rowwise,
                 columnwise, buffers=None, frag_row=None, frag_col=None):
        self.index, self.h, self.w, self.recipe = index, h, w, recipe
        self.master, self.master_dtype, self.start, self.count = master, master_dtype, start, \
            count
        self.rowwise, self.columnwise = rowwise, columnwise
        self.frag_row, self.frag_col = frag_row, frag_col
        self._buffers = buffers

    def buffers(self):
        return self._buffers

    @property
    def row_blocks(self) -> int:
        """Entries this weight contributes to its bucket's rowwise part of the buffer."""
        if isinstance(self.recipe, Block2D):
            return cdiv(self.h, 128) * cdiv(self.w, 128)
        return self.h * (self.w // 32) if self.rowwise else 0

    @property
    def col_blocks(self) -> int:
        if isinstance(self.recipe, Block2D):
            return 0
        return (self.h // 32) * self.w if self.columnwise else 0


# ---- pointer arguments -------------------------------------------------------------------------


class SimPtr:
    """Simulator stand-in for a raw pointer: indexes a flat NumPy array in place. (The simulator
    copies ndarray arguments in and out of every launch, so views of one buffer passed as
    several arguments -- the arena's typed views -- would overwrite each other's writes.)"""

    __slots__ = ("a",)

    def __init__(self, a):
        self.a = a

    def __getitem__(self, i):
        return self.a[i]

    def __setitem__(self, i, v):
        self.a[i] = v


def ptr_arg(arr, dtype):
    """Kernel pointer argument for `arr` indexed as `dtype`: the CuPy array itself on the GPU,
    a :class:`SimPtr` over a flat view under the simulator."""
    if SIM:
        return SimPtr(arr.reshape(-1).view(dtype))
    return arr


# ---- address space ----------------------------------------------------------------------------


class Arena:
    """One base address for a batch's arrays. ``offset(arr, itemsize)`` is arr's position from
    the base in elements of `itemsize` bytes; ``pointers()`` gives the kernel arguments
    (mem32, mem16, mem8, memf); ``finish()`` copies written arrays back (simulator only)."""

    def __init__(self, arrays, written):
        # empty arrays have no address (CuPy gives them pointer 0): never registered
        arrays = [a for a in arrays if a is not None and a.nbytes]
        # only the simulator copies back; on the GPU the arena holds no array (a cached Batch
        # must not keep the caller's arrays alive)
        self._written = [a for a in written if a is not None and a.nbytes] if SIM else []
        if SIM:
            self._pos = {}
            cursor = 0
            for a in arrays:
                if id(a) in self._pos:
                    continue
                cursor = round_up(cursor, 256) + data_ptr(a) % 16
                self._pos[id(a)] = cursor
                cursor += a.nbytes
            # gaps hold 0x7F bytes (fp32/bf16 ~3.4e38): a read past an array shows in tests
            self._pool = np.full(round_up(cursor + 16, 16), 0x7F, np.uint8)
            for a in arrays:
                p = self._pos[id(a)]
                self._pool[p: p + a.nbytes] = a.reshape(-1).view(np.uint8)
            self._base = 0
        else:
            ptrs = [data_ptr(a) for a in arrays]
            self._base = (min(ptrs) // 256 * 256) if ptrs else 0

    def byte_offset(self, arr):
        if SIM:
            return self._pos[id(arr)]
        return data_ptr(arr) - self._base

    def offset(self, arr, itemsize):
        b = self.byte_offset(arr)
        if b % itemsize:
            raise ValueError(f"array at byte offset {b} is not aligned to its {itemsize}-byte "
                             f"elements")
        return b // itemsize

    def pointers(self):
        if SIM:
            p = self._pool
            return (SimPtr(p.view(np.uint32)), SimPtr(p.view(np.uint16)), SimPtr(p),
                    SimPtr(p.view(np.float32)))
        base = np.uint64(self._base)
        return (base, base, base, base)

    def finish(self):
        if SIM:
            for a in self._written:
                p = self._pos[id(a)]
                a.reshape(-1).view(np.uint8)[...] = self._pool[p: p + a.nbytes]


# ---- batch --------------------------------------------------------------------------------------


class Launch:
    """The kernel launches over table rows [first, first + count): ``fast_blocks`` CUDA blocks
    of the fast-path kernel (interior tiles / bands / chunks of aligned shards, no bounds
    checks) and ``blocks`` of the general one (the rest). Either may be 0 (no launch)."""

    __slots__ = ("first", "count", "blocks", "fast_blocks", "with_col")

    def __init__(self, first, count, blocks, fast_blocks, with_col):
        self.first, self.count, self.blocks, self.with_col = first, count, blocks, with_col
        self.fast_blocks = fast_blocks

    def launch(self, kernel_for, threads, args):
        """Launch kernel_for(fast_path) over its blocks, for each path that has any; returns
        the number of launches."""
        launches = 0
        for fast_path, blocks in ((True, self.fast_blocks), (False, self.blocks)):
            if blocks:
                kernel_for(fast_path)((blocks, 1, 1), (threads, 1, 1), args)
                launches += 1
        return launches


_table_cache = BoundedCache(32)
_table_lock = threading.Lock()

#: what the caches did: ``tables_uploaded`` (batch tables copied to the device) and
#: ``batches_built`` (Batch objects made by :func:`batch_for`), cumulative
counters = {"tables_uploaded": 0, "batches_built": 0}


def _device_table(table, xp):
    """The table on the device, reused while its bytes are the same (shards and buffers stay
    put between optimizer steps, so steady state uploads nothing). Entries are per stream: the
    upload (and the pool's reuse of an evicted table) is ordered only on the stream that made
    it, so another thread's stream must not read it. The lock keeps concurrent callers (one
    thread per rank) from evicting the same entry twice."""
    table = table.reshape(-1)
    if xp is np:
        return table
    key = (xp.cuda.get_current_stream().ptr, table.tobytes())
    with _table_lock:
        hit = _table_cache.get(key)
        if hit is None:
            hit = _table_cache.put(key, xp.asarray(table))
            counters["tables_uploaded"] += 1
    return hit


class Batch:
    """Table, arena and launches for the weights of one bucket (a list of :class:`BatchWeight`).

    Rows are ordered with the weights that have no columnwise output first (row-only MXFP8;
    Block2D without transposed data, or with fragments), so each kernel specialization
    covers one contiguous range of rows.
    """

    def __init__(self, items, have_fragments):
        self.block2d = isinstance(items[0].recipe, Block2D)
        some = next(b for b in items[0].buffers() if b is not None)
        self.xp = module_of(some)

        def with_col(it):
            return it.columnwise and not (self.block2d and have_fragments)

        self.items = sorted(items, key=with_col)
        arrays, written = [], []
        for it in self.items:
            arrays.append(it.master)
            for b in it.buffers():
                arrays.append(b)
                written.append(b)
            arrays += [it.frag_row, it.frag_col]
            written += [it.frag_row, it.frag_col]
        self.arena = Arena(arrays, written)
        n = len(self.items)
        t = np.zeros((n, NF), np.int64)
        buf = 0
        for i, it in enumerate(self.items):
            self._fill_row(t[i], it, have_fragments)
            t[i, F_ROWBUF] = buf
            buf += it.row_blocks
            t[i, F_COLBUF] = buf if it.col_blocks else -1
            buf += it.col_blocks
        self.buf_entries = buf
        # launches: by specialization (no columnwise output / with it), prefix sums per launch
        self.amax_launches, self.cast_launches = [], []
        groups = [False, True] if not self.block2d else [None]
        for g in groups:
            idx = [i for i, it in enumerate(self.items) if g is None or with_col(it) == g]
            if not idx:
                continue
            blocks = fast_blocks = 0
            for i in idx:
                t[i, F_AMAX0], t[i, F_AMAXF0] = blocks, fast_blocks
                slow, fast = self._amax_blocks(t[i])
                blocks += slow
                fast_blocks += fast
            if blocks or fast_blocks:
                self.amax_launches.append(Launch(idx[0], len(idx), blocks, fast_blocks,
                                                 bool(g)))
        for g in (False, True):
            idx = [i for i, it in enumerate(self.items) if with_col(it) == g]
            if not idx:
                continue
            blocks = fast_blocks = 0
            for i in idx:
                n_chunks = cdiv(int(t[i, F_N]), CAST_CHUNK)
                nfc = self._fast_chunks(t[i], with_col(self.items[i]))
                t[i, F_NFC] = nfc
                t[i, F_CAST0], t[i, F_CASTF0] = blocks, fast_blocks
                blocks += n_chunks - nfc
                fast_blocks += nfc
            if blocks or fast_blocks:
                self.cast_launches.append(Launch(idx[0], len(idx), blocks, fast_blocks, g))
        entries = 0
        for i, it in enumerate(self.items):
            t[i, F_SCALE0] = entries
            entries += self._scale_entries(it)
        self.scale_entries = entries
        self.table = t
        self.table_dev = _device_table(t, self.xp)
        self.n_items = n

    def _fill_row(self, row, it, have_fragments):
        a = self.arena
        h, w, o, n = it.h, it.w, it.start, it.count
        if h * w >= 2 ** 31:
            raise ValueError(f"weights[{it.index}] has {h * w} elements; the master kernels "
                             f"index with 32 bits (at most 2**31 - 1 elements per weight)")
        row[F_H], row[F_W], row[F_O], row[F_N] = h, w, o, n
        if n:
            bf16 = it.master_dtype == _arrays.BF16
            moff = a.offset(it.master, 2 if bf16 else 4)
            row[F_MOFF], row[F_MBF16] = moff, int(bf16)
            row[F_MVEC] = int(moff % (2 if bf16 else 4) == 0)
            row[F_VEC2D] = int(row[F_MVEC] and o % 4 == 0 and w % 4 == 0)
        r = it.recipe
        row[F_E4M3] = int(r.fmt is E4M3)
        if self.block2d:
            row[F_POW2] = int(r.pow2_scales)
            row[F_EPS] = int(np.float32(r.amax_epsilon).view(np.int32))
        row_data, row_sinv, col_data, col_sinv = it.buffers()
        row[F_HASROW], row[F_HASCOL] = int(it.rowwise), int(it.columnwise)
        if it.rowwise:
            row[F_ROWDATA] = (a.offset(it.frag_row, 1) - o) if it.frag_row is not None else \
                a.offset(row_data, 1)
            row[F_ROWSINV] = a.offset(row_sinv, 4 if self.block2d else 1)
        else:
            row[F_ROWSINV] = -1
        if it.columnwise:
            if self.block2d:
                row[F_COLDATA] = -1 if have_fragments else a.offset(col_data, 1)
            else:
                row[F_COLDATA] = (a.offset(it.frag_col, 1) - o) if it.frag_col is not None \
                    else a.offset(col_data, 1)
            row[F_COLSINV] = a.offset(col_sinv, 4 if self.block2d else 1)
        else:
            row[F_COLSINV] = -1
        band = 128 if self.block2d else 32
        row[F_NCB] = cdiv(w, 128) if self.block2d else cdiv(w, MX_COLS)
        if n:
            row[F_BAND0] = (o // w) // band

    def _amax_blocks(self, row):
        """(general-path, fast-path) CUDA blocks of the weight's partial amax; also sets its
        F_FASTROW0/1. A band row (128 rows of tiles for Block2D, 32 for MXFP8) is fast when
        the shard is aligned (F_VEC2D) and holds every element of the row."""
        n = int(row[F_N])
        if not n:
            return 0, 0
        h, w, o = int(row[F_H]), int(row[F_W]), int(row[F_O])
        bh = 128 if self.block2d else 32
        first, last = int(row[F_BAND0]), ((o + n - 1) // w) // bh

        def inside(b):
            return b * bh * w >= o and (b * bh + bh) * w <= o + n and b * bh + bh <= h

        f0 = first if inside(first) else first + 1
        f1 = last + 1 if inside(last) else last
        if not row[F_VEC2D] or f1 <= f0:
            f0 = f1 = last + 1  # no fast rows: all touched rows are general-path rows
        row[F_FASTROW0], row[F_FASTROW1] = f0, f1
        ncb = int(row[F_NCB])
        return (last - first + 1 - (f1 - f0)) * ncb, (f1 - f0) * ncb

    def _fast_chunks(self, row, with_col):
        """How many leading cast chunks of the shard take the fast path: the full ones, when
        master loads and FP8 word stores are aligned and groups of 4 stay inside a row
        (o % 4 == w % 4 == 0); none for Block2D transposed storage (byte scatter)."""
        o, n = int(row[F_O]), int(row[F_N])
        if not row[F_VEC2D] or (row[F_HASROW] and (row[F_ROWDATA] + o) % 4):
            return 0
        if with_col and (self.block2d or (row[F_COLDATA] + o) % 4):
            return 0
        return n // CAST_CHUNK

    def _scale_entries(self, it):
        h, w = it.h, it.w
        if self.block2d:
            return round_up(cdiv(h, 128), 4) * round_up(cdiv(w, 128), 4)
        e = 0
        if it.rowwise:
            e += round_up(h, 128) * round_up(w // 32, 4)
        if it.columnwise:
            e += round_up(h // 32, 4) * round_up(w, 128)
        return e

    def new_buffer(self):
        """Zeroed packed buffer: fp32 tile amaxes (Block2D) or uint8 E8M0 codes (MXFP8)."""
        return self.xp.zeros(self.buf_entries, np.float32 if self.block2d else np.uint8)

    def finish(self):
        self.arena.finish()


_batch_cache = BoundedCache(16)


def clear_caches():
    """Forget every cached Batch and device table (the next calls build and upload anew)."""
    with _table_lock:
        _batch_cache.clear()
        _table_cache.clear()


def _ptr(arr):
    return 0 if arr is None or not arr.size else data_ptr(arr)


def _item_key(it):
    """Everything of an item a Batch depends on: shapes, recipe, directions, the shard's
    place, and the addresses of every array (not the arrays: a key keeps nothing alive)."""
    return (it.h, it.w, it.recipe, it.rowwise, it.columnwise, it.start, it.count,
            it.master_dtype, _ptr(it.master),
            tuple(_ptr(b) for b in it.buffers()),
            _ptr(it.frag_row), _ptr(it.frag_col))


def batch_for(items, have_fragments):
    """The :class:`Batch` of `items`, reused from an earlier call when every shape, flag and
    address is the same (the steady state of a training loop, where building the table costs
    Python time per weight). Kernels address arrays by pointer, so equal addresses and layouts
    mean an equal batch even if the arrays were replaced. Keyed per CuPy stream like the
    device table. The simulator copies arrays into a pool per call: never cached there."""
    if SIM:
        return Batch(items, have_fragments)
    xp = module_of(next(b for b in items[0].buffers() if b is not None))
    stream = 0 if xp is np else xp.cuda.get_current_stream().ptr
    key = (stream, have_fragments) + tuple(_item_key(it) for it in items)
    with _table_lock:
        hit = _batch_cache.get(key)
    if hit is None:
        hit = Batch(items, have_fragments)
        hit.items = None  # the items hold the caller's arrays; launches need only the table
        with _table_lock:
            _batch_cache.put(key, hit)
            counters["batches_built"] += 1
    return hit


# ---- launches ---------------------------------------------------------------------------------

_MODEL_KIND = {np.dtype(np.float32): sp.F32, _arrays.BF16: sp.BF16,
               np.dtype(np.float16): sp.F16}


def model_kind(dtype):
    """The kernels' model-dtype kind (``_specs.F32`` / ``BF16`` / ``F16``) of a numpy dtype
    (float32, bfloat16, float16): the ``model`` argument of the launches below."""
    kind = _MODEL_KIND.get(np.dtype(dtype))
    if kind is None:
        raise TypeError(f"model dtype must be float32, bfloat16 or float16, got {dtype}")
    return kind


# ('amax', block2d, model, with_col, fast) / ('scale', block2d, vinf) /
# ('cast', block2d, model, with_col, fast) -> kernel
_kernels = {}
_tuning = Tuning(sp.MasterSettings(), (_kernels,))
use_settings = _tuning.use  # (a backend.MasterSettings) -> the previous settings


def _kernel(key, builder, make_spec):
    """The compiled kernel of `key` in this room's table, built from ``make_spec()`` once."""
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = _cache.kernel(builder, make_spec())
    return k


def amax_kernel(block2d, model, with_col, fast_path):
    """The partial-amax kernel of a specialization (see ``_partial_amax_kernel``)."""
    return _kernel(("amax", block2d, model, with_col, fast_path), "partial_amax",
                   lambda: sp.partial_amax_spec(block2d, model, with_col, fast_path,
                                                _tuning.settings))


def launch_partial_amax(batch, buf, model):
    """Partial amaxes (Block2D, fp32) or E8M0 codes (MXFP8, uint8) of every touched block of
    the batch into the zeroed packed `buf`; up to two launches (band rows inside aligned
    shards, the rest) per specialization present. Returns the number of launches."""
    mem32, mem16, _, _ = batch.arena.pointers()
    threads = AMAX2D_THREADS if batch.block2d else MXAMAX_THREADS
    # MXFP8 buffers hold a multiple of 32 codes per weight; Block2D does not use codes32
    codes32 = ptr_arg(buf, np.uint32) if not batch.block2d else ptr_arg(buf, np.float32)
    launches = 0
    for ln in batch.amax_launches:
        launches += ln.launch(
            lambda fast_path: amax_kernel(batch.block2d, model, bool(ln.with_col), fast_path),
            threads, (ptr_arg(batch.table_dev, np.int64), np.int64(ln.first),
                      np.int64(ln.count), ptr_arg(buf, buf.dtype), codes32, mem32, mem16))
    return launches


def scale_kernel(block2d, vinf):
    """The scale kernel of a specialization (see ``_partial_cast_kernel``)."""
    return _kernel(("scale", block2d, vinf), "partial_scale",
                   lambda: sp.PartialScaleSpec(bool(block2d), float(vinf)))


def cast_kernel(block2d, model, with_col, fast_path):
    """The cast kernel of a specialization (see ``_partial_cast_kernel``)."""
    return _kernel(("cast", block2d, model, with_col, fast_path), "partial_cast",
                   lambda: sp.partial_cast_spec(block2d, model, with_col, fast_path,
                                                _tuning.settings))


def launch_scales(batch, buf, vinf):
    """Write every weight's scale_inv (with padding) from the reduced `buf`; for Block2D also
    return the packed fp32 scales the cast reads (None for MXFP8, which casts from the codes)."""
    scales = batch.xp.empty(batch.buf_entries, np.float32) if batch.block2d else None
    if batch.scale_entries:
        _, _, mem8, memf = batch.arena.pointers()
        kernel = scale_kernel(batch.block2d, float(vinf) if batch.block2d else 0.0)
        grid = ((batch.scale_entries + SCALE_THREADS - 1) // SCALE_THREADS, 1, 1)
        head = (ptr_arg(batch.table_dev, np.int64), np.int64(0), np.int64(batch.n_items),
                np.int64(batch.scale_entries))
        if batch.block2d:
            kernel(grid, (SCALE_THREADS, 1, 1),
                   head + (ptr_arg(buf, np.float32), ptr_arg(scales, np.float32), memf))
        else:
            kernel(grid, (SCALE_THREADS, 1, 1), head + (ptr_arg(buf, np.uint8), mem8))
    return scales


def launch_cast(batch, sbuf, model):
    """Cast every owned element of the batch: `sbuf` is the packed fp32 scales (Block2D) or the
    reduced E8M0 codes (MXFP8). Up to two launches (full chunks of aligned shards, the rest)
    per specialization present; returns the count."""
    mem32, mem16, mem8, _ = batch.arena.pointers()
    codes32 = ptr_arg(sbuf, np.float32 if batch.block2d else np.uint32)  # unused by Block2D
    launches = 0
    for ln in batch.cast_launches:
        launches += ln.launch(
            lambda fast_path: cast_kernel(batch.block2d, model, bool(ln.with_col), fast_path),
            CAST_THREADS, (ptr_arg(batch.table_dev, np.int64), np.int64(ln.first),
                           np.int64(ln.count), ptr_arg(sbuf, sbuf.dtype), codes32, mem32,
                           mem16, mem8))
    return launches
