"""The communicator test suite, shared by every multi-rank launcher (MPI, NCCL, torch).

Each rank builds every rank's data from one seed that rank 0 draws and broadcasts, so each
rank can compute the expected result of a collective on its own. Checks raise AssertionError
with the seed and the case in the message; a launcher runs ``run_suite`` and prints
``SUITE OK <rank> <checks>`` at the end, which the pytest side counts.

Array families: ``Family`` adapts NumPy data to the array type under test (NumPy, CuPy, torch)
and back, so the same checks run on host and device buffers.
"""
from __future__ import annotations

import os
import sys
import types
import warnings

import ml_dtypes
import numpy as np

import fp8blk as fb
from fp8blk import _arrays
from fp8blk.comm import gather as gather_module
from fp8blk.comm.gather import paths as gather_paths
from fp8blk.comm import GatherFallbackWarning, gather_along_first_dim, packed_all_gather, \
    packed_all_reduce

BF16 = np.dtype(ml_dtypes.bfloat16)
REDUCE_DTYPES = [np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64),
                 np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]


# --------------------------------------------------------------------------------------------
# Families


class Family:
    """NumPy: arrays as they are."""

    name = "numpy"
    device = False

    def make(self, host):
        return np.array(host, copy=True)

    def back(self, arr, dtype=None):
        host = np.asarray(arr)
        return host if dtype is None else host.view(dtype)

    def strided(self, host):
        """A non-contiguous array with the values of ``host`` (2-D or more)."""
        wide = np.zeros(host.shape[:-1] + (2 * host.shape[-1],), dtype=host.dtype)
        wide[..., ::2] = host
        return self.make(wide)[..., ::2]

    def supports(self, dtype):
        return True


class CupyFamily(Family):
    name = "cupy"
    device = True

    def __init__(self):
        import cupy

        self.cupy = cupy

    def make(self, host):
        host = np.array(host, order="C")  # not ascontiguousarray: it turns 0-d into (1,)
        if host.dtype == BF16:
            host = host.view(np.uint16)  # CuPy has no bfloat16: bit patterns
        return self.cupy.asarray(host)

    def back(self, arr, dtype=None):
        host = self.cupy.asnumpy(arr)
        return host if dtype is None else host.view(dtype)

    def supports(self, dtype):
        return True


class TorchFamily(Family):
    name = "torch"

    def __init__(self, device="cpu"):
        import torch

        self.torch = torch
        self.torch_device = device
        self.device = device != "cpu"

    def make(self, host):
        tensor = _arrays.from_backend(np.array(host, copy=True), _arrays.TORCH)
        return tensor.to(self.torch_device)

    def back(self, arr, dtype=None):
        host, _, _ = _arrays.to_backend(arr.cpu())
        host = np.array(host, copy=True)
        return host if dtype is None else host.view(dtype)

    def strided(self, host):
        wide = np.zeros(host.shape[:-1] + (2 * host.shape[-1],), dtype=host.dtype)
        wide[..., ::2] = host
        return self.make(wide)[..., ::2]


# --------------------------------------------------------------------------------------------
# Infrastructure


class Suite:
    def __init__(self, comm, family, seed, label):
        self.comm, self.family, self.seed, self.label = comm, family, seed, label
        self.count = 0
        self._case = 0
        self.paths = {}  # gather path -> cases checked

    def rng(self):
        """A generator every rank draws identically from (one per case)."""
        self._case += 1
        return np.random.default_rng([self.seed, self._case])

    def check(self, condition, message):
        self.count += 1
        if not condition:
            raise AssertionError(f"[{self.label} rank {self.comm.rank}/{self.comm.size} "
                                 f"seed {self.seed}] {message}")

    def equal(self, got, expected, message):
        """Exact equality; floats compare as values with NaN == NaN (and -0 == +0)."""
        got, expected = np.asarray(got), np.asarray(expected)
        ok = got.shape == expected.shape and got.dtype == expected.dtype
        detail = f"got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
        if ok:
            if got.dtype.kind == "f" or got.dtype == BF16:
                g, e = got.astype(np.float64), expected.astype(np.float64)
                same = (g == e) | (np.isnan(g) & np.isnan(e))
            else:
                same = got == expected
            ok = bool(np.all(same))
            bad = np.argwhere(~same)
            detail += f"; {len(bad)} differ, first at {bad[:3].tolist()}"
        self.check(ok, f"{message}: {detail}")

    def raises(self, kind, fn, message, contains=None):
        try:
            fn()
        except kind as error:
            self.check(contains is None or contains in str(error),
                       f"{message}: wrong message {error}")
            return error
        self.check(False, f"{message}: no {kind.__name__} raised")


def shared_seed(comm):
    seed = np.array([int.from_bytes(os.urandom(4), "little")], dtype=np.int64)
    comm.broadcast(seed, root=0)
    return int(seed[0])


def _values(rng, dtype, shape, op, size):
    """Data one rank contributes: exact-sum integers for "sum", specials for "max"."""
    if dtype.kind in "ui":
        if op == "sum":
            high = 255 // size if dtype == np.uint8 else 1000
            return rng.integers(0, high + 1, shape).astype(dtype)
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=np.int64 if dtype.itemsize == 8
                            else np.int64).astype(dtype)
    if op == "sum":
        # quarters of small integers: with up to 4 ranks every partial sum is a multiple of
        # 1/4 below 64, exact in bf16 (8 significant bits) whatever the order of summation
        return (rng.integers(-12, 13, shape) * 0.25).astype(dtype)
    values = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    flat = values.reshape(-1)
    for special in (np.nan, np.inf, -np.inf, 0.0, -0.0):
        if flat.size:
            flat[rng.integers(0, flat.size, max(1, flat.size // 16))] = special
    return values.astype(dtype)


def _reduce(stack, dtype, op):
    if op == "sum":
        return stack.astype(np.float64 if dtype.kind == "f" or dtype == BF16
                            else np.int64).sum(axis=0).astype(dtype)
    if dtype.kind in "ui":
        return stack.max(axis=0)
    return np.fmax.reduce(stack.astype(np.float64), axis=0).astype(dtype)


# --------------------------------------------------------------------------------------------
# Collectives


def check_collectives(s: Suite):
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    shapes = [(0,), (1,), (7,), (3, 5, 7), (130, 3)]
    for dtype in REDUCE_DTYPES:
        for op in ("sum", "max"):
            for shape in shapes:
                rng = s.rng()
                every = np.stack([_values(rng, dtype, shape, op, n) for _ in range(n)])
                expected = _reduce(every, dtype, op)
                for async_op in (False, True):
                    buf = fam.make(every[me])
                    result = comm.all_reduce(buf, op=op, async_op=async_op, dtype=str(dtype))
                    if async_op:
                        got = result.wait()
                        s.check(got is buf and result.wait() is buf,
                                "all_reduce Handle.wait() returns the buffer, twice")
                    else:
                        s.check(result is None, "synchronous all_reduce returns None")
                    s.equal(fam.back(buf, dtype), expected,
                            f"all_reduce {op} {dtype} {shape} async={async_op}")
            # reduce_scatter: (n*rows, ...) -> rows of this rank
            rng = s.rng()
            rows = int(rng.integers(0, 4))
            every = np.stack([_values(rng, dtype, (n * rows, 3), op, n) for _ in range(n)])
            expected = _reduce(every, dtype, op)[me * rows:(me + 1) * rows]
            inp = fam.make(every[me])
            out = comm.reduce_scatter(inp, op=op, dtype=str(dtype))
            s.equal(fam.back(out, dtype), expected, f"reduce_scatter {op} {dtype}")
            s.equal(fam.back(inp, dtype), every[me], "reduce_scatter leaves its input intact")
            handle = comm.reduce_scatter(fam.make(every[me]), op=op, async_op=True,
                                         dtype=str(dtype))
            s.equal(fam.back(handle.wait(), dtype), expected, f"async reduce_scatter {op}")

    # all_gather, all_gather_v, broadcast: bytes of any dtype
    for dtype in (np.dtype(np.uint8), BF16, np.dtype(np.float32), np.dtype(np.int64)):
        for rows in (0, 1, 5):
            rng = s.rng()
            every = [_values(rng, dtype, (rows, 3, 2), "max", n) for _ in range(n)]
            expected = np.concatenate(every)
            got = comm.all_gather(fam.make(every[me]))
            s.equal(fam.back(got, dtype), expected, f"all_gather {dtype} rows={rows}")
            out = fam.make(np.zeros_like(expected))
            handle = comm.all_gather(fam.make(every[me]), out=out, async_op=True)
            s.check(handle.wait() is out and handle.wait() is out, "async all_gather -> out")
            s.equal(fam.back(out, dtype), expected, f"async all_gather into out {dtype}")
        if rows and dtype != BF16:
            strided = fam.strided(every[me].reshape(rows, 6))
            got = comm.all_gather(strided)
            s.equal(fam.back(got, dtype), expected.reshape(-1, 6), "all_gather strided input")
        rng = s.rng()
        counts = [int(c) for c in rng.integers(0, 6, n)]
        every = [_values(rng, dtype, (c,), "max", n) for c in counts]
        for async_op in (False, True):
            got = comm.all_gather_v(fam.make(every[me]), counts, async_op=async_op)
            got = got.wait() if async_op else got
            s.equal(fam.back(got, dtype), np.concatenate(every), f"all_gather_v {counts}")
        for root in range(n):
            rng = s.rng()
            every = [_values(rng, dtype, (4, 3), "max", n) for _ in range(n)]
            buf = fam.make(every[me])
            comm.broadcast(buf, root=root)
            s.equal(fam.back(buf, dtype), every[root], f"broadcast {dtype} root={root}")
    buf = fam.make(np.arange(6, dtype=np.float32) + me)
    comm.broadcast(buf, root=n - 1, async_op=True).wait()
    s.equal(fam.back(buf), np.arange(6, dtype=np.float32) + n - 1, "async broadcast")
    comm.barrier()

    # counters: data collectives with their bytes; barriers and metadata apart
    comm.reset_stats()
    buf = fam.make(np.ones((5, 7), np.float32))
    comm.all_reduce(buf, op="max")
    comm.all_gather(fam.make(np.ones((3, 2), np.uint8)))
    comm.reduce_scatter(fam.make(np.ones((2 * n, 4), np.float16)), dtype="float16")
    comm.barrier()
    st = comm.stats
    s.check(st.calls == 3 and st["calls"] == 3, f"stats.calls {st}")
    s.check(st.bytes == 140 + 6 + 2 * n * 4 * 2, f"stats.bytes {st}")
    s.check(st.meta_calls == 1 and st.ops["all_reduce"] == [1, 140], f"stats {st}")
    comm.reset_stats()
    s.check(comm.stats.calls == 0 and comm.stats.bytes == 0, "reset_stats")

    # argument errors are raised locally, before anything is sent (identically on all ranks)
    s.raises(ValueError, lambda: comm.all_reduce(fam.make(np.ones(3, np.float32)), op="min"),
             "op min")
    if not fam.device and fam.name == "numpy":
        wide = np.ones((4, 4), np.float32)
        s.raises(ValueError, lambda: comm.all_reduce(wide[:, ::2]), "strided in-place buffer",
                 contains="contiguous")
    s.raises(ValueError, lambda: comm.reduce_scatter(fam.make(np.ones((n * 2 + 1, 2),
                                                                      np.float32))),
             "reduce_scatter rows", contains="divisible") if n > 1 else None
    s.raises(TypeError, lambda: comm.all_reduce(fam.make(np.ones(3, np.int16))),
             "int16 reduction")
    s.check(comm.stats.calls == 0, "rejected calls send nothing")


# --------------------------------------------------------------------------------------------
# Packed helpers


def check_packed(s: Suite):
    comm, fam, n, me = s.comm, s.family, s.comm.size, s.comm.rank
    for dtype in (np.dtype(np.float32), BF16, np.dtype(np.uint8), np.dtype(np.float16)):
        for op in ("max", "sum"):
            rng = s.rng()
            shapes = [tuple(int(d) for d in rng.integers(0, 5, rng.integers(0, 3)))
                      for _ in range(int(rng.integers(1, 7)))]
            every = [[_values(rng, dtype, shape, op, n) for shape in shapes] for _ in range(n)]
            arrays = [fam.make(a) for a in every[me]]
            comm.reset_stats()
            got = packed_all_reduce(comm, arrays, op, dtype=str(dtype))
            s.check(got is arrays, "packed_all_reduce returns its list")
            s.check(comm.stats.calls == 1 and comm.stats.meta_calls == 1,
                    f"packed_all_reduce: one data collective + one check {comm.stats}")
            for i, shape in enumerate(shapes):
                expected = _reduce(np.stack([every[r][i] for r in range(n)]), dtype, op)
                s.equal(fam.back(arrays[i], dtype), expected,
                        f"packed_all_reduce {op} {dtype} array {i} {shape}")
            arrays = [fam.make(a) for a in every[me]]
            comm.reset_stats()
            handle = packed_all_reduce(comm, arrays, op, check=False, async_op=True,
                                       dtype=str(dtype))
            s.check(handle.wait() is arrays and handle.wait() is arrays, "async packed")
            s.check(comm.stats.calls == 1 and comm.stats.meta_calls == 0, "check=False")
            for i in range(len(shapes)):
                expected = _reduce(np.stack([every[r][i] for r in range(n)]), dtype, op)
                s.equal(fam.back(arrays[i], dtype), expected, f"async packed {op} {dtype}")
    # strided targets are written back too
    if fam.name != "cupy":
        rng = s.rng()
        every = [_values(rng, np.dtype(np.float32), (3, 8), "max", n) for _ in range(n)]
        target = fam.strided(every[me])
        packed_all_reduce(comm, [target], "max")
        s.equal(fam.back(target.contiguous() if fam.name == "torch" else target),
                _reduce(np.stack(every), np.dtype(np.float32), "max"), "strided packed target")

    # packed all-gather of mixed dtypes: FP8 bytes, fp32 scales, bf16
    rng = s.rng()
    shapes = [((int(rng.integers(0, 4)), 5), np.dtype(np.uint8)), ((3,), np.dtype(np.float32)),
              ((2, 2), BF16)]
    every = [[_values(rng, d, shape, "max", n) for shape, d in shapes] for _ in range(n)]
    for async_op in (False, True):
        comm.reset_stats()
        got = packed_all_gather(comm, [fam.make(a) for a in every[me]], async_op=async_op)
        got = got.wait() if async_op else got
        s.check(comm.stats.calls == 1, "packed_all_gather: one data collective")
        for i, (shape, dtype) in enumerate(shapes):
            s.equal(fam.back(got[i], dtype), np.concatenate([every[r][i] for r in range(n)]),
                    f"packed_all_gather {dtype}")

    # layout mismatches: every rank raises the same clear error, nobody hangs
    if n > 1:
        extra = 1 if me == 0 else 0
        s.raises(ValueError, lambda: packed_all_reduce(
            comm, [fam.make(np.ones(4 + extra, np.float32))], "max"),
            "mismatched packed size", contains="disagree on the number")
        dtype = np.float32 if me == 0 else np.int32
        s.raises(ValueError, lambda: packed_all_reduce(
            comm, [fam.make(np.ones(4, dtype))], "max"),
            "mismatched packed dtype", contains="not on the layout")
        op = "max" if me == 0 else "sum"
        s.raises(ValueError, lambda: packed_all_reduce(comm, [fam.make(np.ones(4, np.float32))],
                                                       op),
                 "mismatched op", contains="not on the layout")
        s.raises(ValueError, lambda: packed_all_gather(
            comm, [fam.make(np.ones((2 + extra, 3), np.uint8))]),
            "mismatched packed_all_gather", contains="disagree")
    s.raises(TypeError, lambda: packed_all_reduce(
        comm, [fam.make(np.ones(2, np.float32)), fam.make(np.ones(2, np.float16))], "max"),
        "mixed dtypes", contains="one dtype")


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
        every = [_values(rng, dtype, (r, 2, 3), "max", n) for r in rows]
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
            if recipe is None:
                s.equal(fam.back(got), np.concatenate(data), f"{label}: {what}")
            else:
                _compare(s, fam, got, _expected_gather(data, recipe, True, columnwise),
                         f"{label}: {what}")
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
            if recipe is None:
                s.equal(fam.back(got), np.concatenate(data), f"{label}: {what}")
            else:
                _compare(s, fam, got, _expected_gather(data, recipe, True, columnwise),
                         f"{label}: {what}")
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
        every = [_values(rng, dtype, (r,), "max", n) for r in lengths]
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


def run_suite(comm, family, label, parts=("collectives", "packed", "gather")):
    seed = shared_seed(comm)
    s = Suite(comm, family, seed, label)
    if "collectives" in parts:
        check_collectives(s)
    if "packed" in parts:
        check_packed(s)
    if "gather" in parts:
        check_gather(s)
        check_gather_reuse(s)
        check_gather_invalid_with_sizes(s)
    if "gather" in parts or "sizes" in parts:
        check_gather_malformed_sizes(s)
    if "gather" in parts or "plain" in parts:
        check_plain_gather(s)
    comm.barrier()
    print(f"SUITE OK {label} rank {comm.rank}/{comm.size} checks {s.count} seed {seed} "
          f"gather paths {sorted(s.paths.items())}", flush=True)
    sys.stdout.flush()
    return s.count
