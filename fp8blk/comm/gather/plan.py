"""What a gather knows before any data moves (docs/distributed.md, "Quantized all-gather"):
the local input checked (:class:`Source`), the metadata every rank agrees on, the plan (path,
byte counts per rank and buffer, where each part lands) and the per-communicator plan cache
that keeps the metadata exchange off the steady state."""
from __future__ import annotations

import numpy as np

from ... import _arrays
from ..._bounded import BoundedCache
from ...formats import MXFP8, Block1D, Block2D, check_mxfp8_shape, check_recipe, recipe_key
from ...layout import all_layouts, c_strides, cdiv, round_up
from ...tensor import BlockTensor, internal_buffers
from ..agree import fingerprint

STATUS_BYTES = 8  # the in-band status of a sizes= plan: one int64 per rank
FAST, FALLBACK, PLAIN = "fast", "fallback", "plain"
ROW, COL = "rowwise", "columnwise"
SLOT, STAGED = "slot", "staged"
_NUMPY = _arrays.NUMPY
_RECIPE_TYPES = (Block1D, Block2D, MXFP8)
_HIGH_PRECISION = frozenset(_arrays.HIGH_PRECISION)


# plans per communicator; evicted in insertion order (lookups never reorder them), which is
# the same on every rank because every rank inserts the same plans in the same order
CACHE_SIZE = 64


class Source:
    """What this rank holds: an array in its own family, or a BlockTensor (``is_block``)."""

    __slots__ = ("is_block", "x", "family", "dtype", "shape", "recipe", "rowwise", "columnwise",
                 "buffers", "has_row", "has_col", "dim0", "k", "m", "row_elems", "device")

    def __init__(self, x, recipe, rowwise, columnwise):
        self.rowwise, self.columnwise = bool(rowwise), bool(columnwise)
        if isinstance(x, BlockTensor):
            self._from_block_tensor(x, recipe)
        else:
            self._from_array(x, recipe)
        shape = self.shape
        self.dim0 = shape[0]
        self.k = shape[-1]
        row_elems = 1
        for d in shape[1:]:
            row_elems *= d
        self.row_elems = row_elems  # elements per dim-0 row (the plain gather's unit)
        self.m = self.dim0 * _inner(shape)  # rows of the (M, K) view
        if self.recipe is not None:
            if not (self.rowwise or self.columnwise):
                raise ValueError("gather_along_first_dim needs rowwise=True or "
                                 "columnwise=True (or both) when quantizing")
            if len(shape) < 2:
                raise ValueError(f"gather_along_first_dim with a recipe needs an input of at "
                                 f"least two dims (..., K), got shape {shape}: gathering "
                                 f"a 1-D input along dim 0 would change K")
        if self.is_block:
            self._check_buffers()

    def _from_array(self, x, recipe):
        self.is_block = False
        family = _NUMPY if type(x) is np.ndarray else _arrays.family_of(x)
        self.family = family
        if family == _arrays.TORCH:
            self.dtype = _torch_dtype(x)
            if not x.is_contiguous():
                x = x.contiguous()  # strided inputs are copied
        else:
            self.dtype = np.dtype(x.dtype)
            if not x.flags.c_contiguous:
                x = (np if family == _arrays.NUMPY else _arrays.cupy_module()).ascontiguousarray(x)
        if x.ndim == 0:
            raise ValueError("gather_along_first_dim needs an array with at least one dim "
                             "(it concatenates along dim 0)")
        self.x = x
        self.shape = tuple(x.shape) if family != _arrays.TORCH else tuple(int(d) for d in x.shape)
        self.recipe = recipe
        self.buffers = None
        self.has_row = self.has_col = False
        self.device = family == _arrays.CUPY or (family == _arrays.TORCH and x.is_cuda)
        if recipe is not None:
            if type(recipe) not in _RECIPE_TYPES:
                check_recipe(recipe)
            if self.dtype not in _HIGH_PRECISION:
                raise TypeError(f"gather_along_first_dim quantizes float32, bfloat16 or "
                                f"float16 input, got {self.dtype}")

    def _from_block_tensor(self, x, recipe):
        self.is_block = True
        if recipe is not None and recipe != x.recipe:
            raise ValueError(f"x is a BlockTensor quantized with {x.recipe!r} but recipe="
                             f"{recipe!r} was given: pass recipe=None (or the same recipe), "
                             f"or dequantize x first to requantize it")
        self.buffers = list(internal_buffers(x))
        held = [b for b in self.buffers if b is not None]
        if not held:
            raise ValueError("the BlockTensor holds neither rowwise nor columnwise data")
        public = x.rowwise_data if x.has_rowwise else x.columnwise_data
        self.family = _arrays.family_of(public)
        self.x = None
        self.recipe = x.recipe
        self.dtype = np.dtype(x.dtype)
        self.shape = tuple(x.shape)
        self.has_row = self.buffers[0] is not None
        self.has_col = self.buffers[2] is not None
        self.device = _arrays.on_gpu(held[0])
        if self.dtype not in _arrays.HIGH_PRECISION:
            raise TypeError(f"the BlockTensor's dtype {self.dtype} is not float32, bfloat16 "
                            f"or float16")
        if len(self.shape) == 0:
            raise ValueError("the BlockTensor has a 0-d shape: nothing to gather along dim 0")

    def _check_buffers(self):
        for i, (buf, layout) in enumerate(zip(self.buffers,
                                              all_layouts(self.recipe, self.m, self.k))):
            if buf is not None and (tuple(buf.shape) != layout.shape
                                    or _arrays.logical_dtype(buf) != layout.dtype
                                    or not _arrays.is_contiguous(buf)):
                name = ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                        "columnwise_scale_inv")[i]
                raise ValueError(f"the BlockTensor's {name} is {buf.dtype}{tuple(buf.shape)}, "
                                 f"expected C-contiguous {layout.dtype}{layout.shape} for "
                                 f"shape {self.shape} and {type(self.recipe).__name__}")

    def describe(self):
        return (f"shape {self.shape}, dtype {self.dtype}, recipe {self.recipe!r}, "
                f"{'BlockTensor' if self.is_block else 'array'}, rowwise={self.rowwise}, "
                f"columnwise={self.columnwise}")


def _torch_dtype(x):
    try:
        return _arrays.numpy_dtype(x.dtype)
    except TypeError:
        raise TypeError(f"torch dtype {x.dtype} cannot be gathered by fp8blk; use float32, "
                        f"bfloat16 or float16, or x.view(torch.uint8) for FP8 bytes") from None


def check_sizes(sizes, size):
    """``sizes`` as a tuple of ints (dim-0 rows per rank), or an error naming the problem.
    (Whether ``sizes[rank]`` matches this rank's input is checked by the exchange on the first
    call and by :meth:`Plan.expects` on later ones.)"""
    try:
        sizes = tuple(int(s) for s in sizes)
    except (TypeError, ValueError):
        raise TypeError(f"sizes must be a sequence of ints (dim-0 rows per rank), got "
                        f"{sizes!r}") from None
    if len(sizes) != size or min(sizes, default=0) < 0:
        raise ValueError(f"sizes must give one non-negative row count per rank ({size}), "
                         f"got {list(sizes)}")
    return sizes
_FIELDS = ("error", "dim0", "shape", "dtype", "recipe", "is_block", "has_row", "has_col",
           "rowwise", "columnwise", "sizes")
_MUST_AGREE = {"shape": "the shape after dim 0", "dtype": "the dtype", "recipe": "the recipe",
               "is_block": "the input kind (array or BlockTensor)",
               "rowwise": "rowwise=", "columnwise": "columnwise=",
               "sizes": "sizes= (every rank must pass the same list, or None)"}


def meta_row(src, sizes, error):
    if error is not None:
        return np.array([1] + [0] * (len(_FIELDS) - 1), dtype=np.int64)
    recipe = "" if src.recipe is None else recipe_key(src.recipe)
    return np.array([0, src.dim0, fingerprint(src.shape[1:]), fingerprint(str(src.dtype)),
                     fingerprint(recipe), int(src.is_block), int(src.has_row),
                     int(src.has_col), int(src.rowwise), int(src.columnwise),
                     fingerprint(sizes)], dtype=np.int64)


def exchange(comm, src, sizes, error):
    """Every rank's metadata row, as {field: column}; raises the same error on every rank
    when any rank's input was rejected or the ranks disagree."""
    row = meta_row(src, sizes, error)
    if comm.size == 1:
        table = row.reshape(1, -1)
    else:
        table = comm.meta_all_gather(row)
    columns = {name: table[:, i] for i, name in enumerate(_FIELDS)}
    bad = [int(r) for r in np.flatnonzero(columns["error"])]
    if bad:
        if error is not None:
            raise error
        raise ValueError(f"gather_along_first_dim: rank(s) {bad} rejected their input (see "
                         f"the error raised there); no data was exchanged")
    for field, what in _MUST_AGREE.items():
        column = columns[field]
        if (column != column[0]).any():
            raise ValueError(f"gather_along_first_dim: ranks disagree on {what} (this rank: "
                             f"{src.describe()}); every rank must pass the same")
    if sizes is not None and [int(d) for d in columns["dim0"]] != list(sizes):
        raise ValueError(f"gather_along_first_dim: sizes={list(sizes)} but the ranks hold "
                         f"{[int(d) for d in columns['dim0']]} rows along dim 0")
    return columns, fingerprint(table.tobytes()) >> 1


class Part:
    """One buffer's bytes of every rank: ``counts[r]`` bytes per rank, gathered into the
    target buffer's flat bytes from offset 0 (``SLOT``: the ranks' parts are consecutive
    there) or into a staging buffer, rank-major, and then moved into place (``STAGED``)."""

    __slots__ = ("index", "mode", "counts", "displs", "local_layout", "total", "strides")

    def __init__(self, index, mode, counts, local_layout):
        self.index, self.mode, self.counts = index, mode, counts
        self.displs = [sum(counts[:r]) for r in range(len(counts))]
        self.local_layout = local_layout
        self.total = sum(counts)
        self.strides = c_strides(local_layout.shape)


class Plan:
    """Everything about one gather configuration that does not depend on the data."""

    def __init__(self, src, columns, comm_size, rank, table_hash, sized=False):
        self.table_hash = table_hash
        # the data collectives carry the in-band status (fp8blk.comm.gather.status): a plan
        # made with sizes= on more than one rank, whose peers exchange no metadata
        self.carries_status = sized and comm_size > 1
        self.lane = None  # the lane: steady-state record of the last sizes=/out= call
        self.rank = rank
        self.size = comm_size
        self.dim0s = [int(d) for d in columns["dim0"]]
        self.recipe, self.dtype, self.is_block = src.recipe, src.dtype, src.is_block
        self.rowwise, self.columnwise = src.rowwise, src.columnwise
        self.row_held = [bool(h) for h in columns["has_row"]]
        self.col_held = [bool(h) for h in columns["has_col"]]
        self.out_shape = (sum(self.dim0s),) + src.shape[1:]
        self.K = src.k
        if src.recipe is None:
            itemsize = src.dtype.itemsize
            self.counts = [d * src.row_elems * itemsize for d in self.dim0s]
            self.path, self.reason = PLAIN, None
            self.parts, self.fills, self.moves, self.targets = [], [], [], []
            self.ms, self.offsets, self.M = self.dim0s, None, None
            return
        unit = _inner(src.shape)
        self.ms = [d * unit for d in self.dim0s]
        self.offsets = [sum(self.ms[:r]) for r in range(comm_size)]
        self.M = sum(self.ms)
        self.path, self.reason, self.directions = self._decide(src)
        # the fallback: directions gathered as the ranks hold them (``directions``), the
        # others derived after the gather (``derived``), from the dequantized kept direction
        # or, with none kept, from gathered high-precision data (``hp_gather``) dequantized
        # per rank from ``hp_source`` (None: each rank's own direction, rowwise first)
        self.derived, self.hp_gather, self.hp_source = [], False, None
        if self.path == FALLBACK:
            wanted = self.directions
            self.directions = self._kept(wanted)
            self.derived = [d for d in wanted if d not in self.directions]
            self.hp_gather = not self.directions
            self.hp_source = (ROW if all(self.row_held) else COL if all(self.col_held)
                              else None) if self.is_block else None
        self.derive_columnwise = (isinstance(self.recipe, Block2D) and self.columnwise
                                  and self.path == FAST)
        self.targets = self._targets()
        self.parts, self.fills, self.moves = (self._layout_parts() if self.directions
                                              and (self.path == FAST or self.is_block)
                                              else ([], [], []))
        # per-call constants of the fast path
        self.out_layouts = all_layouts(self.recipe, self.M, self.K)
        self.row_q = self.path == FAST and ROW in self.directions
        self.col_q = self.path == FAST and COL in self.directions
        self.quantized = [self.row_q, self.row_q, self.col_q, self.col_q]
        self.direct = comm_size == 1 and not self.is_block  # the local quantize is the output
        self.checked_out = None  # (out, its buffers) last validated as this plan's out=
        self.prepared = None     # paths' prepared views and items for the last targets

    # -- the path ------------------------------------------------------------------------
    def _aligned(self, block):
        return all(o % block == 0 for o, m in zip(self.offsets, self.ms) if m > 0)

    def _decide(self, src):
        recipe, name = self.recipe, type(self.recipe).__name__
        wanted = [d for d, on in ((ROW, self.rowwise), (COL, self.columnwise)) if on]
        check_mxfp8_shape(recipe, self.M, self.K, f"the gathered tensor (local rows {self.ms})")
        if self.is_block and not isinstance(recipe, Block2D):
            for direction, held in ((ROW, self.row_held), (COL, self.col_held)):
                lacking = [r for r, h in enumerate(held) if not h]
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

    def _kept(self, wanted):
        """The asked directions of a BlockTensor fallback that every rank holds and whose
        blocks lie within one rank's rows (their bytes are gathered as they are)."""
        if not self.is_block or isinstance(self.recipe, Block2D):
            return []
        as_is = {ROW: True,
                 COL: (self._aligned(128) if isinstance(self.recipe, Block1D)
                       else all(m % 32 == 0 for m in self.ms))}
        held = {ROW: all(self.row_held), COL: all(self.col_held)}
        return [d for d in wanted if held[d] and as_is[d]]

    def _targets(self):
        """Indices of the output buffers that are written (rowwise 0, 1; columnwise 2, 3)."""
        if self.path == FAST:
            indices = set()
            for d in self.directions:
                indices |= {0, 1} if d == ROW else {2, 3}
            if self.derive_columnwise:
                indices |= {2, 3}
            return sorted(indices)
        return sorted(({0, 1} if self.rowwise else set()) | ({2, 3} if self.columnwise
                                                              else set()))

    # -- the fast path's parts -------------------------------------------------------------
    def local_rows(self):
        """Rows this rank quantizes: MXFP8 pads a shard to a multiple of 32 (rowwise only)."""
        m = self.ms[self.rank]
        return round_up(m, 32) if isinstance(self.recipe, MXFP8) else m

    def _layout_parts(self):
        """(parts, fills, moves): the buffers gathered; the scale padding to write, as
        ``(index, byte offset, shape, strides in elements, value)``; and the staged parts'
        rank blocks to move into place, as 2-D byte copies ``(index, dst offset, dst pitch,
        src offset in the staging, src pitch, width, height)`` (one per non-empty rank:
        on the device each is one cudaMemcpy2DAsync)."""
        recipe, K, M = self.recipe, self.K, self.M
        local = all_layouts(recipe, self.local_rows(), K)
        parts, moves = [], []

        def slot(index, per_rank):
            parts.append(Part(index, SLOT, [per_rank(m) for m in self.ms], local[index]))

        def staged(index, per_rank, item, height, dst_pitch, src_pitch):
            """Rank r's staged block (height, src_pitch(m_r) bytes per row) holds its m_r
            columns of ``item`` bytes first; they go to columns [o_r, o_r + m_r) of the
            target, whose rows are ``dst_pitch`` bytes apart."""
            part = Part(index, STAGED, [per_rank(m) for m in self.ms], local[index])
            parts.append(part)
            for m, o, displ in zip(self.ms, self.offsets, part.displs):
                if m and height:
                    moves.append((index, o * item, dst_pitch, displ, src_pitch(m), m * item,
                                  height))

        fills = []
        if isinstance(recipe, Block1D):
            kb = cdiv(K, 128)
            if ROW in self.directions:
                slot(0, lambda m: m * K)
                # scales (kb, round4(M)) fp32: rank r's rows are columns [o_r, o_r + m_r)
                staged(1, lambda m: kb * round_up(m, 4) * 4, 4, kb, round_up(M, 4) * 4,
                       lambda m: round_up(m, 4) * 4)
                if round_up(M, 4) > M:  # padding columns of the (kb, round4(M)) scales
                    fills.append((1, M * 4, (kb, round_up(M, 4) - M), (round_up(M, 4), 1),
                                  1.0))
            if COL in self.directions:
                # columnwise data (K, M): rank r's (K, m_r) block is columns [o_r, o_r + m_r)
                staged(2, lambda m: K * m, 1, K, M, lambda m: m)
                slot(3, lambda m: cdiv(m, 128) * round_up(K, 4) * 4)
        elif isinstance(recipe, Block2D):
            slot(0, lambda m: m * K)
            slot(1, lambda m: cdiv(m, 128) * round_up(cdiv(K, 128), 4) * 4)
        else:
            c32 = round_up(K // 32, 4)
            if ROW in self.directions:
                slot(0, lambda m: m * K)
                slot(1, lambda m: m * c32)
                if round_up(M, 128) > M:
                    fills.append((1, M * c32, (round_up(M, 128) - M, c32), (c32, 1), 0))
            if COL in self.directions:
                r128 = round_up(K, 128)
                slot(2, lambda m: m * K)
                slot(3, lambda m: (m // 32) * r128)
                if round_up(M // 32, 4) > M // 32:
                    fills.append((3, (M // 32) * r128, (round_up(M // 32, 4) - M // 32, r128),
                                  (r128, 1), 0))
        return parts, fills, moves

    def sent_bytes(self):
        sent = self.__dict__.get("_sent")
        if sent is None:
            sent = self._sent = self._sent_bytes()
        return sent

    def _sent_bytes(self):
        """Bytes this rank sends: its parts, the fallback's high-precision rows, and the 8
        bytes of the in-band status."""
        status = STATUS_BYTES if self.carries_status else 0
        if self.path == PLAIN:
            return self.counts[self.rank] + status
        kept = sum(p.counts[self.rank] for p in self.parts) + status
        if self.path == FAST or not self.hp_gather:
            return kept
        return kept + self.dim0s[self.rank] * _row_bytes(self)

    def hp_counts(self):
        """Bytes per rank of the fallback's high-precision part."""
        row_bytes = self.K * self.dtype.itemsize
        return [m * row_bytes for m in self.ms]

    def expects(self, src):
        """None if this rank's input fits the plan; else what differs (sizes= hit path)."""
        if src.dim0 != self.dim0s[self.rank]:
            return (f"this rank's input has {src.dim0} rows along dim 0 but sizes[{self.rank}]"
                    f" = {self.dim0s[self.rank]}")
        if (src.has_row, src.has_col) != (self.row_held[self.rank], self.col_held[self.rank]):
            return ("this rank's BlockTensor holds other directions than on the first call "
                    "with these sizes")
        return None

    def serves(self, src):
        """Whether this plan gathers what the valid input ``src`` is: its configuration (the
        key without sizes), this rank's rows and held directions."""
        return (self.is_block == src.is_block and self.out_shape[1:] == src.shape[1:]
                and self.dtype == src.dtype and self.recipe == src.recipe
                and self.rowwise == src.rowwise and self.columnwise == src.columnwise
                and self.expects(src) is None)


def _inner(shape):
    inner = 1
    for d in shape[1:-1]:
        inner *= d
    return inner


def _row_bytes(plan):
    """High-precision bytes per dim-0 row (the fallback's traffic)."""
    rest = 1
    for d in plan.out_shape[1:]:
        rest *= d
    return rest * plan.dtype.itemsize


class PlanCache:
    """Plans of one communicator, bounded: the oldest inserted plan goes first (lookups
    do not reorder, so every rank inserts and evicts identically).

    ``lanes``: {id(out): lane} of the ``sizes=``/``out=`` steady state
    (:mod:`fp8blk.comm.gather.paths`): at most one lane per cached plan (``plan.lane``),
    dropped with its plan, so that a lane is found only while the plan it belongs to is
    cached, on every rank alike (a lane hit then issues exactly what a plan-cache hit issues:
    no metadata).

    ``recent``: {id(plan): (plan, ops)} of the checked ``sizes=`` calls, the latest last
    (``ops``: the array operations its data moved with), dropped with its plan like a lane:
    what a rank whose own input or ``sizes`` is invalid joins so that peers on a cache hit
    complete (:meth:`last_sizes_call`).

    ``watch``: the pending device statuses of ``sizes=`` gathers
    (:class:`fp8blk.comm.gather.status.Watch`), None until a device gather makes it."""

    def __init__(self):
        self.watch = None
        self.plans = BoundedCache(CACHE_SIZE, on_evict=self._evict)
        self._index = {}  # key -> plan: lookups that leave the eviction order alone
        self.lanes = {}
        self.recent = {}
        self.hits = self.misses = 0

    def get(self, key):
        return self._index.get(key)

    def put(self, key, plan):
        old = self._index.get(key)
        if old is not None:
            self._forget(old)
        self._index[key] = plan
        self.plans.put(key, plan)

    def _evict(self, key, plan):
        del self._index[key]
        self._forget(plan)

    def note_sizes_call(self, plan, ops):
        """Record ``plan`` (cached, keyed with ``sizes``) as the latest checked sizes= call."""
        self.recent.pop(id(plan), None)
        self.recent[id(plan)] = (plan, ops)

    def last_sizes_call(self, match):
        """(plan, ops) of the latest checked ``sizes=`` call whose plan satisfies
        ``match(plan)``, or None."""
        for plan, ops in reversed(list(self.recent.values())):
            if match(plan):
                return plan, ops
        return None

    def _forget(self, plan):
        """``plan`` leaves the cache: so do its lane and its ``recent`` record, so that
        neither outlives what peers can hit."""
        self._forget_lane(plan)
        self.recent.pop(id(plan), None)

    def keep_lane(self, plan, lane, out):
        """Make ``lane`` the steady-state lane of ``plan`` for ``out`` (one per plan, and one
        per ``out``: a lane it replaces is dropped)."""
        self._forget_lane(plan)
        other = self.lanes.get(id(out))
        if other is not None:
            self._forget_lane(other.plan)
        plan.lane = lane
        self.lanes[id(out)] = lane

    def _forget_lane(self, plan):
        lane = plan.lane
        if lane is not None:
            plan.lane = None
            if self.lanes.get(id(lane.out)) is lane:
                del self.lanes[id(lane.out)]


def local_key(src, sizes):
    """The key of this rank's call. With ``sizes`` it holds only what every rank passes
    identically (so all ranks hit or miss together); without, this rank's full input."""
    if sizes is not None:
        return (True, src.is_block, src.shape[1:], src.dtype, src.recipe, src.rowwise,
                src.columnwise, sizes)
    return (False, src.is_block, src.shape, src.dtype, src.recipe, src.rowwise, src.columnwise,
            src.has_row, src.has_col)
