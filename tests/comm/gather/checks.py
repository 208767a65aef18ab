"""The quantized gather's checks: the multi-rank suite's (run by ``run_suite`` of
tests/comm/scripts/checks.py in the launches of tests/comm/test_multirank.py, on every rank)
and what the thread-rank and GPU gather tests share (an input with rows of very different
magnitudes, the byte-for-byte comparison of two BlockTensors)."""
from __future__ import annotations

import types
import warnings

import numpy as np

import fp8blk as fb
from fp8blk.comm import GatherFallbackWarning, gather_along_first_dim
from fp8blk.comm import gather as gather_module
from fp8blk.comm.gather import paths as gather_paths
from tests._same import BUFFERS as NAMES, same_bytes
from tests.comm.scripts.checks import BF16, Family, Suite, values


def gather_input(rng, rows, k):
    """(rows, k) float32 whose rows span eight decades (per-block scales differ)."""
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-4, 4, (rows, 1))
    return x.astype(np.float32)


def assert_same_bytes(got, expected, host=None, label=()):
    """Every buffer of BlockTensor ``got`` has the shape and bytes of ``expected``'s (None
    where it is None); ``host(buf)``, if given, makes a buffer a NumPy array first (otherwise
    ``tests._same.to_host`` copies device buffers)."""
    for name in NAMES:
        g, e = getattr(got, name), getattr(expected, name)
        if host is not None:
            g, e = (None if g is None else host(g)), (None if e is None else host(e))
        problem = same_bytes(g, e)
        assert problem is None, (*label, name, problem)


# --------------------------------------------------------------------------------------------
# gather_along_first_dim


RECIPES = [fb.Block1D(), fb.Block1D(fb.E5M2, pow2_scales=False, amax_epsilon=1e-3),
           fb.Block2D(), fb.Block2D(fb.E5M2, pow2_scales=False), fb.MXFP8(), fb.MXFP8(fb.E5M2)]
DIRECTIONS = [(True, False), (False, True), (True, True)]


def _global_input(rng, rows, rest, dtype):
    """(rows, *rest) high-precision data whose blocks get different scales: in the (M, K) view
    a magnitude 10^U{-4..3} per 128x128 tile times 2^U{0..3} per row (so 1x32 / 1x128 / 128x1
    blocks and 128x128 tiles differ), special values in two rows of one tile (a block holding
    an inf or 3e38 takes that value's scale: scattered everywhere they would give every tile
    the same scale), and an all-zero 1x128 block."""
    shape = (rows,) + rest
    k = rest[-1]
    m = int(np.prod(shape)) // k if k else 0
    tiles = 10.0 ** rng.integers(-4, 4, (-(-m // 128), -(-k // 128)))
    mag = np.repeat(np.repeat(tiles, 128, 0), 128, 1)[:m, :k] * 2.0 ** rng.integers(0, 4, (m, 1))
    x2 = (rng.standard_normal((m, k)) * mag).astype(np.float32)
    if x2.size:
        specials = np.array([np.nan, np.inf, -np.inf, 0.0, 3e38, 1e-30, -7e4], np.float32)
        # one 128x128 tile holds them all
        r0, c0 = 128 * int(rng.integers(0, -(-m // 128))), 128 * int(rng.integers(0, -(-k // 128)))
        width = min(128, k - c0)
        for r in rng.integers(r0, min(r0 + 128, m), 2):
            picks = c0 + rng.integers(0, width, max(1, width // 8))
            x2[r, picks] = rng.choice(specials, picks.size)
        r = int(rng.integers(0, m))
        x2[r, : min(128, k)] = 0.0  # an all-zero block
    with np.errstate(over="ignore"):
        return x2.reshape(shape).astype(dtype)


def _row_split(rng, kind, n, unit, multiple):
    """Rows (dim 0) per rank. kind: aligned | last | ragged; ``unit`` rows of M per dim-0 row;
    ``multiple``: alignment in M rows (128 or 32)."""
    step = max(1, multiple // unit) if multiple % unit == 0 else multiple
    if kind == "aligned":
        rows = [step * int(rng.integers(0, 3)) for _ in range(n)]
        rows[int(rng.integers(0, n))] += step
    elif kind == "last":
        rows = [step * int(rng.integers(1, 3)) for _ in range(n - 1)]
        rows.append(int(rng.integers(0, 2 * step)))
    else:
        rows = [int(rng.choice([0, 1, 2, 31, 33, 127, 129, 200])) for _ in range(n)]
    return rows


def _expected_path(recipe, rowwise, columnwise, ms, kind, held):
    """The path the rules of docs/distributed.md (as refined in fp8blk.comm.gather) pick."""
    offsets = np.concatenate([[0], np.cumsum(ms)[:-1]])
    aligned = all(o % 128 == 0 for o, m in zip(offsets, ms) if m)
    if kind == "block" and not isinstance(recipe, fb.Block2D):
        if (rowwise and not held[0]) or (columnwise and not held[1]):
            return "fallback"
    if isinstance(recipe, fb.Block1D):
        return "fallback" if columnwise and not aligned else "fast"
    if isinstance(recipe, fb.Block2D):
        return "fast" if aligned else "fallback"
    return "fallback" if columnwise and any(m % 32 for m in ms) else "fast"


def _kept_directions(recipe, ms, held):
    """"r" / "c" for the directions a BlockTensor fallback gathers as the ranks hold them."""
    if isinstance(recipe, fb.Block2D):
        return ""
    offsets = np.concatenate([[0], np.cumsum(ms)[:-1]])
    col_as_is = (all(o % 128 == 0 for o, m in zip(offsets, ms) if m)
                 if isinstance(recipe, fb.Block1D) else all(m % 32 == 0 for m in ms))
    return ("r" if held[0] else "") + ("c" if held[1] and col_as_is else "")


def _buffers(fam, q):
    return [None if b is None else fam.back(b) for b in
            (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv)]


def _compare(s, fam, got, expected, label):
    s.check(isinstance(got, fb.BlockTensor), f"{label}: a BlockTensor")
    s.check(got.shape == expected.shape and got.recipe == expected.recipe
            and got.dtype == expected.dtype,
            f"{label}: shape/recipe/dtype {got.shape} {got.dtype} vs {expected.shape} "
            f"{expected.dtype}")
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    for name, g, e in zip(names, _buffers(fam, got), _buffers(Family(), expected)):
        if e is None or g is None:
            s.check(e is None and g is None, f"{label}: {name} held {g is not None}, "
                                             f"expected {e is not None}")
            continue
        same_layout = g.shape == e.shape and g.dtype == e.dtype
        differing = int((g.view(np.uint8) != e.view(np.uint8)).sum()) if same_layout else -1
        s.check(same_layout and differing == 0,
                f"{label}: {name} bytes differ ({g.dtype}{g.shape} vs {e.dtype}{e.shape}; "
                f"{differing} bytes)")



def _exact(s, fam, got, data, recipe, columnwise, what):
    """The gathered `got` equals the plain concatenation of `data` (recipe None) or the
    quantization of it, byte for byte."""
    if recipe is None:
        s.equal(fam.back(got), np.concatenate(data), what)
    else:
        _compare(s, fam, got, _expected_gather(data, recipe, True, columnwise), what)

def _one_gather(s, recipe, rowwise, columnwise, rows, rest, dtype, kind, held, async_op,
                strided=False):
    comm, fam, me = s.comm, s.family, s.comm.rank
    rng = s.rng()
    full = _global_input(rng, sum(rows), rest, dtype)
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(int)
    local = full[offsets[me]: offsets[me + 1]]
    unit = int(np.prod(rest[:-1], dtype=np.int64))
    ms = [r * unit for r in rows]
    if kind == "block":
        blocks = []
        for r in range(comm.size):
            part = full[offsets[r]: offsets[r + 1]]
            blocks.append(fb.quantize(np.ascontiguousarray(part), recipe, rowwise=held[0],
                                      columnwise=held[1]))
        x = fb.quantize(fam.make(local), recipe, rowwise=held[0], columnwise=held[1])
    else:
        x = fam.strided(local) if strided else fam.make(local)
    path = _expected_path(recipe, rowwise, columnwise, ms, kind, held)
    expected = fb.quantize(full, recipe, rowwise=rowwise, columnwise=columnwise)
    if kind == "block" and path == "fallback":
        # a BlockTensor that has to fall back keeps the directions every rank holds whose
        # blocks lie within a rank (their bytes are those of quantize of the whole); the
        # others are quantized from the shards dequantized (to their own dtype)
        source = np.concatenate([b.dequantize(dtype=dtype) for b in blocks])
        derived = fb.quantize(source, recipe, rowwise=rowwise, columnwise=columnwise)
        kept = _kept_directions(recipe, ms, held)
        expected = types.SimpleNamespace(shape=expected.shape, recipe=recipe, dtype=expected.dtype,
                                         **{name: getattr(expected if name[0] in kept
                                                          else derived, name)
                                            for name in ("rowwise_data", "rowwise_scale_inv",
                                                         "columnwise_data",
                                                         "columnwise_scale_inv")})
    label = (f"gather {recipe} rowwise={rowwise} columnwise={columnwise} rows={rows} "
             f"rest={rest} {dtype} {kind} held={held} async={async_op} strided={strided}")
    comm.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GatherFallbackWarning)
        out, handle = gather_along_first_dim(x, comm, None if kind == "block" else recipe,
                                             rowwise=rowwise, columnwise=columnwise,
                                             async_op=async_op)
    if async_op:
        s.check(handle is not None, f"{label}: a handle")
        s.check(handle.wait() is out and handle.wait() is out, f"{label}: wait() -> out")
    else:
        s.check(handle is None, f"{label}: no handle when synchronous")
    s.paths[path] = s.paths.get(path, 0) + 1
    s.check(comm.stats.last_gather_path == path,
            f"{label}: path {comm.stats.last_gather_path}, expected {path}")
    # one data collective; metadata: none at one rank, else a 16-byte check (+ the exchange
    # on the first call of a configuration)
    meta = comm.stats.meta_calls
    s.check(comm.stats.calls == 1 and (meta == 0 if comm.size == 1 else meta in (1, 2)),
            f"{label}: one data collective and at most a check + an exchange {comm.stats}")
    _compare(s, fam, out, expected, label)
    return out


def check_gather(s: Suite):
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    dtypes = [np.dtype(np.float32), np.dtype(np.float16)]
    if fam.name != "cupy":
        dtypes.append(BF16)
    for recipe in RECIPES:
        mx = isinstance(recipe, fb.MXFP8)
        for rowwise, columnwise in DIRECTIONS:
            for split in ("aligned", "last", "ragged"):
                rng = s.rng()
                rest = (int(rng.choice([32, 96, 160])),) if mx else \
                    (int(rng.choice([1, 64, 130, 300])),)
                if rng.integers(0, 3) == 0:
                    rest = (2,) + rest if split != "aligned" or not mx else (4,) + rest
                unit = int(np.prod(rest[:-1], dtype=np.int64))
                rows = _row_split(rng, split, n, unit, 32 if mx else 128)
                if mx and (sum(rows) * unit) % 32:
                    rows[-1] += (32 - (sum(rows) * unit) % 32) // unit if 32 % unit == 0 \
                        else 0
                    if (sum(rows) * unit) % 32:
                        continue
                dtype = dtypes[int(rng.integers(0, len(dtypes)))]
                async_op = bool(rng.integers(0, 2))
                _one_gather(s, recipe, rowwise, columnwise, rows, rest, dtype, "array",
                            None, async_op, strided=bool(rng.integers(0, 2)))
                # BlockTensor inputs: holding what is asked, or only one direction
                held_options = [(rowwise, columnwise), (True, False), (False, True)]
                held = held_options[int(rng.integers(0, 3))]
                if mx and any(r * unit % 32 for r in rows):
                    continue  # an MXFP8 shard must be a multiple of 32 rows to be quantized
                _one_gather(s, recipe, rowwise, columnwise, rows, rest, dtype, "block", held,
                            not async_op)

    # the Block1D rowwise fast path moves 1 byte per element plus the scales
    rng = s.rng()
    rows = [int(rng.integers(1, 150))] * n  # equal shards: no backend pads them
    k = 300
    x = fam.make(_global_input(rng, sum(rows), (k,), np.dtype(np.float32))[
        sum(rows[:me]): sum(rows[:me + 1])])
    comm.reset_stats()
    gather_along_first_dim(x, comm, fb.Block1D())
    # data, plus the (3, round4(rows)) fp32 scales as quantized (sent whole: no packing copy)
    payload = rows[me] * k + 4 * 3 * (-(-rows[me] // 4) * 4)
    s.check(comm.stats.bytes == payload and comm.stats.calls == 1,
            f"Block1D rowwise traffic {comm.stats.bytes} for payload {payload}")

    # no recipe: a plain all-gather along dim 0, any dtype
    for dtype in (np.dtype(np.int64), BF16, np.dtype(np.float32)):
        if fam.name == "cupy" and dtype == BF16:
            continue
        rng = s.rng()
        rows = [int(r) for r in rng.integers(0, 4, n)]
        every = [values(rng, dtype, (r, 2, 3), "max", n) for r in rows]
        out, handle = gather_along_first_dim(fam.make(every[me]), comm)
        s.check(handle is None and comm.stats.last_gather_path == "plain", "plain path")
        s.equal(fam.back(out, dtype), np.concatenate(every), f"plain gather {dtype}")

    # the fallback warns once per call site
    if n > 1:
        gather_paths.warned_sites.clear()  # a site seen by an earlier run would stay silent
        rows = [100] * n
        x = fam.make(np.ones((100, 256), np.float32))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                gather_along_first_dim(x, comm, fb.Block2D())
            gather_along_first_dim(x, comm, fb.Block2D())  # another call site
        ours = [w for w in caught if issubclass(w.category, GatherFallbackWarning)]
        s.check(len(ours) == 2, f"fallback warnings: {len(ours)} (expected one per site)")
        s.check(all(w.filename == __file__ for w in ours), "the warning points at the caller")

    # errors: every rank raises, none hangs
    x = fam.make(np.ones((4, 64), np.float32))
    s.raises(ValueError, lambda: gather_along_first_dim(x, comm, fb.Block1D(), rowwise=False),
             "no usage", contains="rowwise=True")
    s.raises(ValueError, lambda: gather_along_first_dim(fam.make(np.ones(64, np.float32)),
                                                        comm, fb.Block1D()),
             "1-D input", contains="two dims")
    if n > 1:
        k = 64 if me else 96
        s.raises(ValueError, lambda: gather_along_first_dim(fam.make(np.ones((4, k),
                                                                             np.float32)),
                                                            comm, fb.Block1D()),
                 "mismatched K", contains="disagree on the shape")
        bad = np.ones((4, 64), np.int32 if me == n - 1 else np.float32)
        error = s.raises((TypeError, ValueError),
                         lambda: gather_along_first_dim(fam.make(bad), comm, fb.Block1D()),
                         "one rank's bad dtype")
        if me != n - 1:
            s.check(f"[{n - 1}]" in str(error), f"names the rank: {error}")
        recipe = fb.Block1D() if me == 0 else fb.Block2D()
        s.raises(ValueError, lambda: gather_along_first_dim(x, comm, recipe),
                 "mismatched recipe", contains="disagree on the recipe")
    s.raises(ValueError, lambda: gather_along_first_dim(
        fam.make(np.ones((n * 3, 64), np.float32)), comm, fb.MXFP8()),
        "MXFP8 M not a multiple of 32", contains="multiples of 32")


def _expected_gather(every, recipe, rowwise, columnwise):
    return fb.quantize(np.concatenate(every), recipe, rowwise=rowwise, columnwise=columnwise)


def check_gather_reuse(s: Suite):
    """out= reuse, sizes= (right and wrong), asynchronous handles waited out of order, the
    plan cache (hits, and misses when a rank changes shape), plain 1-D gathers."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    cache = gather_module.plan_cache(comm)
    f32 = np.dtype(np.float32)
    cases = [(fb.Block1D(), True, False, 77), (fb.Block1D(), True, True, 128),
             (fb.MXFP8(), True, False, 32), (fb.Block2D(), False, True, 128),
             (fb.MXFP8(fb.E5M2), True, True, 64)]
    for recipe, rowwise, columnwise, rows in cases:
        rng = s.rng()
        k = int(rng.choice([64, 160, 288])) if isinstance(recipe, fb.MXFP8) else \
            int(rng.choice([1, 130, 300]))
        label = f"reuse {recipe} rowwise={rowwise} columnwise={columnwise} rows={rows} k={k}"
        target = None
        for step in range(3):
            every = [_global_input(rng, rows, (k,), f32) for _ in range(n)]
            expected = _expected_gather(every, recipe, rowwise, columnwise)
            sizes = [rows] * n if step == 2 else None
            comm.reset_stats()
            got, handle = gather_along_first_dim(fam.make(every[me]), comm, recipe, rowwise,
                                                 columnwise, async_op=step == 1, sizes=sizes,
                                                 out=target)
            if handle is not None:
                s.check(handle.wait() is got, f"{label}: wait() -> out")
            if target is not None:
                s.check(got is target, f"{label} step {step}: out= is returned")
            target = got
            _compare(s, fam, got, expected, f"{label} step {step}")
            s.check(comm.stats.calls == 1, f"{label}: one data collective {comm.stats}")
            if n == 1:
                s.check(comm.stats.meta_calls == 0, f"{label}: no metadata at one rank")
            elif step == 1:
                s.check(comm.stats.meta_calls == 1, f"{label}: steady state = one check "
                                                    f"{comm.stats}")
        # steady state with sizes: no metadata at all
        comm.reset_stats()
        every = [_global_input(rng, rows, (k,), f32) for _ in range(n)]
        got, _ = gather_along_first_dim(fam.make(every[me]), comm, recipe, rowwise, columnwise,
                                        sizes=[rows] * n, out=target)
        s.check(comm.stats.meta_calls == 0 and comm.stats.calls == 1,
                f"{label}: sizes= steady state sends no metadata {comm.stats}")
        _compare(s, fam, got, _expected_gather(every, recipe, rowwise, columnwise),
                 f"{label} sizes steady state")
    # a wrong out= is rejected on every rank before anything moves (identical arguments)
    x = fam.make(np.ones((4, 64), np.float32))
    wrong = fb.quantize(fam.make(np.ones((4 * n + 1, 64), np.float32)), fb.Block1D())
    s.raises(ValueError, lambda: gather_along_first_dim(x, comm, fb.Block1D(), out=wrong),
             "out of the wrong shape", contains="shape")

    # asynchronous handles waited out of order
    rng = s.rng()
    rows = [int(r) for r in rng.integers(0, 200, n)]
    firsts = [_global_input(rng, r, (256,), f32) for r in rows]
    seconds = [_global_input(rng, r, (256,), f32) for r in rows]
    q1, h1 = gather_along_first_dim(fam.make(firsts[me]), comm, fb.Block1D(), async_op=True)
    q2, h2 = gather_along_first_dim(fam.make(seconds[me]), comm, fb.MXFP8(), async_op=True) \
        if sum(rows) % 32 == 0 else \
        gather_along_first_dim(fam.make(seconds[me]), comm, fb.Block1D(fb.E5M2), async_op=True)
    recipe2 = q2.recipe
    s.check(h2.wait() is q2 and h1.wait() is q1, "out-of-order waits return their outputs")
    _compare(s, fam, q1, _expected_gather(firsts, fb.Block1D(), True, False), "async first")
    _compare(s, fam, q2, _expected_gather(seconds, recipe2, True, False), "async second")

    # the plan cache: hit on a repeat, miss everywhere when one rank changes its shape
    rng = s.rng()
    base = [int(r) for r in rng.integers(1, 100, n)]
    for step, change in enumerate((False, False, True, True, False)):
        rows = list(base)
        if change:
            rows[n - 1] += 1  # only the last rank's input changes
        every = [_global_input(rng, r, (200,), f32) for r in rows]
        hits, misses = cache.hits, cache.misses
        got, _ = gather_along_first_dim(fam.make(every[me]), comm, fb.Block1D())
        _compare(s, fam, got, _expected_gather(every, fb.Block1D(), True, False),
                 f"cache step {step} rows {rows}")
        # step 4: the last rank's key finds the plan of step 0, the others' keys (unchanged)
        # were re-planned at step 2: the check sees different plans, every rank re-exchanges
        expect_hit = step in (1, 3) or (step == 4 and n == 1)
        s.check((cache.hits - hits, cache.misses - misses) == ((1, 0) if expect_hit else (0, 1)),
                f"cache step {step}: hits {cache.hits - hits}, misses {cache.misses - misses}")

    # sizes= wrong: every rank raises the same clear error
    x = fam.make(np.ones((3 + me, 64), np.float32))
    true_sizes = [3 + r for r in range(n)]
    s.raises(ValueError, lambda: gather_along_first_dim(x, comm, fb.Block1D(),
                                                        sizes=true_sizes + [1]),
             "sizes of the wrong length", contains="one non-negative row count per rank")
    if n > 1:
        lying = list(true_sizes)
        lying[n - 1] += 1
        s.raises(ValueError, lambda: gather_along_first_dim(x, comm, fb.Block1D(), sizes=lying),
                 "sizes that do not match the inputs", contains="sizes=")
        mine = list(true_sizes) if me else list(true_sizes[::-1])
        s.raises(ValueError, lambda: gather_along_first_dim(x, comm, fb.Block1D(), sizes=mine),
                 "ranks passing different sizes", contains="disagree on sizes=")
        # after a checked first call, a rank whose rows no longer match raises; the others
        # raise from its in-band status (no metadata moves) and nobody hangs
        gather_along_first_dim(x, comm, fb.Block1D(), sizes=true_sizes)
        bad = fam.make(np.ones((3 + me + (1 if me == n - 1 else 0), 64), np.float32))
        if me == n - 1:
            s.raises(ValueError, lambda: gather_along_first_dim(bad, comm, fb.Block1D(),
                                                                sizes=true_sizes),
                     "stale sizes on one rank", contains="joined the collectives with zeros")
        else:
            _peer_raises(s, fam, lambda: gather_along_first_dim(bad, comm, fb.Block1D(),
                                                                sizes=true_sizes)[0],
                         "peers of a stale rank", f"rank {n - 1} passed an input that is "
                         f"invalid or does not match these sizes",
                         lambda got: s.check(got.shape == (sum(true_sizes), 64),
                                             "peers of a stale rank: the gathered shape"))
        # and the next checked call works again
        got, _ = gather_along_first_dim(x, comm, fb.Block1D(), sizes=true_sizes)
        s.check(got.shape == (sum(true_sizes), 64), "a good call after the stale one")


def _invalid_input(fam, x, bad):
    if bad == "int32":
        return fam.make(np.ones(x.shape, np.int32))  # TypeError: not a high-precision dtype
    if bad == "1-D":
        return fam.make(x[0])  # ValueError: a 1-D input with a recipe
    return fam.make(np.ones((), x.dtype))  # ValueError: a 0-d input


def check_gather_invalid_with_sizes(s: Suite):
    """The sizes= steady state (peers hit their cached plan, or out='s lane, and skip every
    metadata collective) when one rank's input is invalid: that rank joins the peers'
    collectives with zeros and raises its own error, the peers receive zeros for its rows and
    raise a ValueError naming it (from its in-band status: host arrays in that call, device
    arrays in check_pending), and the next call is exact everywhere. Nothing hangs (a probe
    for metadata the peers never exchange would)."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    if n == 1:
        return
    f32, k, last = np.dtype(np.float32), 256, n - 1
    for path, bad, with_out in (("fast", "int32", False), ("fast", "1-D", True),
                                ("fast", "int32", True), ("fallback", "1-D", False),
                                ("fallback", "int32", True), ("plain", "0-d", False),
                                ("plain", "0-d", True)):
        label = f"invalid input on rank {last} ({bad}), {path}, out={with_out}"
        rng = s.rng()
        recipe = None if path == "plain" else fb.Block1D()
        columnwise = path == "fallback"  # Block1D columnwise across unaligned ranks
        rows = [100 if path == "fallback" and r == 0 else 64 * (1 + r % 2) for r in range(n)]
        every = [[_global_input(rng, r, (k,), f32) for r in rows] for _ in range(5)]

        def call(x, out):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GatherFallbackWarning)
                return gather_along_first_dim(x, comm, recipe, True, columnwise, sizes=rows,
                                              out=out)[0]

        def exact(got, data, what):
            _exact(s, fam, got, data, recipe, columnwise, f"{label}: {what}")
        out = None
        for step in range(3):
            got = call(fam.make(every[step][me]), out)
            exact(got, every[step], f"call {step}")
            out = got if with_out else None
        comm.reset_stats()
        if me == last:
            s.raises(TypeError if bad == "int32" else ValueError,
                     lambda: call(_invalid_input(fam, every[3][me], bad), out),
                     f"{label}: raises", contains="with zeros so that no rank waits")
        else:
            _peer_raises(s, fam, lambda: call(fam.make(every[3][me]), out), label,
                         f"rank {last} passed an input that is invalid",
                         lambda got: _check_peers_got_zeros(s, fam, got, every[3], recipe, path,
                                                            label, exact))
        exact(call(fam.make(every[4][me]), out), every[4], "the next call")
        s.check(comm.stats.meta_calls == 0, f"{label}: no metadata moved {comm.stats}")


def _peer_raises(s, fam, joined, label, contains, check_zeros):
    """A peer's side of a gather the last rank joined with zeros (``joined()``): host arrays
    raise its ValueError in the call; device arrays complete it (``check_zeros(result)``) and
    raise in ``check_pending``, which waits for the status copy (a later gather would raise
    at its end too). Nothing is pending after."""
    if not fam.device:
        s.raises(ValueError, joined, f"{label}: the peers raise", contains=contains)
        return
    check_zeros(joined())
    s.raises(ValueError, lambda: gather_module.check_pending(s.comm),
             f"{label}: the peers raise in check_pending", contains=contains)
    gather_module.check_pending(s.comm)  # nothing more


def _check_peers_got_zeros(s, fam, got, data, recipe, path, label, exact):
    """A peer's result of a gather the last rank joined with zeros: the fast path's FP8 bytes
    (zero bytes and zero scales, as that rank sent them), else the exact gather of the
    inputs with that rank's rows zeroed."""
    zeroed = data[:-1] + [np.zeros_like(data[-1])]
    if path == "fast":
        want = _expected_gather(zeroed, recipe, True, False).rowwise_data
        s.check(np.array_equal(fam.back(got.rowwise_data).view(np.uint8), want.view(np.uint8)),
                f"{label}: the peers' data")
    else:
        exact(got, zeroed, "the peers, zeros for the bad rank's rows")


def check_gather_malformed_sizes(s: Suite):
    """One rank's sizes= malformed (too short, negative, not ints) while its peers pass the
    true sizes: on a first call every rank raises; after checked calls (the peers hit their
    cached plan and skip all metadata) that rank joins their collectives with zeros and
    raises its sizes error, the peers receive zeros for its rows and raise a ValueError
    naming it (host arrays in that call, asynchronous ones in wait(); device arrays in
    check_pending), and the next call is exact. Nothing hangs (the launcher's timeout fails
    the test otherwise)."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    if n == 1:
        return
    f32, k, last = np.dtype(np.float32), 256, n - 1
    for case, (path, malformed) in enumerate((("fast", "short"), ("fast", "negative"),
                                              ("fallback", "not-ints"), ("plain", "short"))):
        label = f"malformed sizes ({malformed}) on rank {last}, {path}"
        rng = s.rng()
        recipe = None if path == "plain" else fb.Block1D()
        columnwise = path == "fallback"
        # rows no earlier call used, so that the first call is one
        rows = [107 + case if path == "fallback" and r == 0 else 64 * (1 + r % 2) + 7 + case
                for r in range(n)]
        bad = {"short": rows[:-1], "negative": rows[:-1] + [-1],
               "not-ints": ["many"] * n}[malformed]
        kind = TypeError if malformed == "not-ints" else ValueError
        every = [[_global_input(rng, r, (k,), f32) for r in rows] for _ in range(4)]

        def call(x, sizes, async_op=False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GatherFallbackWarning)
                got, handle = gather_along_first_dim(x, comm, recipe, True, columnwise,
                                                     sizes=sizes, async_op=async_op)
                return got if handle is None else handle.wait()

        def exact(got, data, what):
            _exact(s, fam, got, data, recipe, columnwise, f"{label}: {what}")
        mine = fam.make(every[0][me])
        s.raises(kind if me == last else ValueError,
                 lambda: call(mine, bad if me == last else rows), f"{label}: a first call")
        for step in range(2):
            exact(call(fam.make(every[step][me]), rows), every[step], f"call {step}")
        comm.reset_stats()
        async_op = case % 2 == 1  # the peers' wait() raises (host arrays)
        if me == last:
            s.raises(kind, lambda: call(fam.make(every[2][me]), bad, async_op),
                     f"{label}: raises", contains="with zeros so that no rank waits")
        else:
            _peer_raises(s, fam, lambda: call(fam.make(every[2][me]), rows, async_op), label,
                         f"rank {last} passed sizes= that are malformed",
                         lambda got: _check_peers_got_zeros(s, fam, got, every[2], recipe, path,
                                                            label, exact))
        exact(call(fam.make(every[3][me]), rows), every[3], "the next call")
        s.check(comm.stats.meta_calls == 0, f"{label}: no metadata moved {comm.stats}")


def check_plain_gather(s: Suite):
    """Plain gathers (no recipe): 1-D inputs of different lengths per rank, with and without
    sizes=, into out=; one rank's invalid input makes every rank raise."""
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    for dtype in (np.dtype(np.int64), np.dtype(np.float32)):
        rng = s.rng()
        lengths = [int(r) for r in rng.integers(0, 9, n)]
        every = [values(rng, dtype, (r,), "max", n) for r in lengths]
        for sizes in (None, lengths, lengths):
            out, _ = gather_along_first_dim(fam.make(every[me]), comm, sizes=sizes)
            s.equal(fam.back(out, dtype), np.concatenate(every),
                    f"plain 1-D {dtype} lengths {lengths} sizes {sizes}")
        target = fam.make(np.zeros(sum(lengths), dtype))
        out, handle = gather_along_first_dim(fam.make(every[me]), comm, out=target,
                                             async_op=True)
        s.check(handle.wait() is target and out is target, "plain out= is returned")
        s.equal(fam.back(target, dtype), np.concatenate(every), "plain 1-D into out=")
    # a rank whose own input is invalid makes every rank raise
    if n > 1:
        bad = fam.make(np.ones((), np.float32)) if me == n - 1 else \
            fam.make(np.ones(4, np.float32))
        error = s.raises((TypeError, ValueError), lambda: gather_along_first_dim(bad, comm),
                         "plain: one rank's 0-d input")
        if me != n - 1:
            s.check(f"[{n - 1}]" in str(error), f"names the rank: {error}")


def run_gather_checks(s: Suite, parts):
    """The gather checks that ``parts`` (of comm_suite / torch_suite) select."""
    if "gather" in parts:
        check_gather(s)
        check_gather_reuse(s)
        check_gather_invalid_with_sizes(s)
    if "gather" in parts or "sizes" in parts:
        check_gather_malformed_sizes(s)
    if "gather" in parts or "plain" in parts:
        check_plain_gather(s)
