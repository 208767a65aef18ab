"""In-process tests of fp8blk.comm's pieces that need no second rank: Handle, Stats, the
NaN-ignoring MAX keys, argument checks of the Communicator base class, the gather's layout
table against fb.quantize, and importing fp8blk.comm without mpi4py / CuPy / torch."""
import subprocess
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import fp8blk as fb
from fp8blk.comm import Communicator, Handle, Stats
from fp8blk.comm.base import float_to_max_keys, max_keys_to_float
from fp8blk.comm.gather.status import record_path
from fp8blk.layout import all_layouts as buffer_layouts

BF16 = np.dtype(ml_dtypes.bfloat16)


# -- Handle -----------------------------------------------------------------------------------

def test_handle_waits_and_posts_once():
    calls = []
    handle = Handle(waiter=lambda: calls.append("wait"), post=lambda: calls.append("post") or 7)
    assert not handle.done
    assert handle.wait() == 7 and handle.wait() == 7 and handle.done
    assert calls == ["wait", "post"]


def test_handle_failure_is_sticky_and_not_retried():
    calls = []

    def post():
        calls.append("post")
        raise RuntimeError("boom")
    handle = Handle(post=post)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            handle.wait()
    assert calls == ["post"]


def test_handle_then_chains_and_forwards_result():
    order = []
    inner = Handle(waiter=lambda: order.append("inner"), result="x")
    outer = inner.then(lambda: order.append("post"))
    assert outer.wait() == "x" and outer.wait() == "x"
    assert order == ["inner", "post"] and inner.done
    assert Handle.completed(3).wait() == 3


# -- Stats --------------------------------------------------------------------------------------

def test_stats_record_and_reset():
    stats = Stats()
    stats.record("all_reduce", 40)
    stats.record("all_gather", 8)
    stats.record("all_reduce", 16, meta=True)
    record_path(SimpleNamespace(stats=stats), "fast")
    assert (stats.calls, stats.bytes, stats.meta_calls, stats.meta_bytes) == (2, 48, 1, 16)
    assert stats["calls"] == 2 and stats.ops == {"all_reduce": [1, 40], "all_gather": [1, 8]}
    assert stats.as_dict()["gather_paths"] == {"fast": 1} and stats.last_gather_path == "fast"
    stats.reset()
    assert stats.as_dict()["calls"] == 0 and stats.last_gather_path is None


# -- NaN-ignoring MAX through integer keys ---------------------------------------------------

@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BF16,
                                   np.dtype(np.float64)])
def test_max_keys_give_fmax(dtype, rng):
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40], np.float64)
    stack = (rng.standard_normal((3, 400)) * 10.0 ** rng.integers(-5, 5, (3, 400)))
    mask = rng.random((3, 400)) < 0.2
    stack[mask] = rng.choice(specials, size=int(mask.sum()))  # every special, every run
    stack[0, 4:4 + len(specials)] = specials                   # (and for sure)
    stack[:, :3] = np.nan  # all-NaN columns stay NaN
    stack[0, 3], stack[1, 3], stack[2, 3] = -0.0, 0.0, np.nan  # +0 beats -0
    stack = stack.astype(dtype)
    keys = [float_to_max_keys(row.copy(), dtype) for row in stack]
    # order-preserving: sorting by key sorts the non-NaN values
    flat_keys = np.concatenate(keys)
    values = stack.reshape(-1).astype(np.float64)
    order = np.argsort(flat_keys, kind="stable")
    finite = values[order][~np.isnan(values[order])]
    assert np.all(finite[1:] >= finite[:-1])
    assert np.all(flat_keys[np.isnan(values)] == np.iinfo(flat_keys.dtype).min)
    reduced = np.max(np.stack(keys), axis=0)
    max_keys_to_float(reduced)
    got = reduced.view(dtype).astype(np.float64)
    expected = np.fmax.reduce(stack.astype(np.float64), axis=0)
    assert np.array_equal(got, expected, equal_nan=True)
    assert np.signbit(got[3]) == False  # noqa: E712
    # and the round trip restores every non-NaN bit pattern
    row = stack[0].copy()
    bits = row.view(np.dtype(f"u{dtype.itemsize}")).copy()
    max_keys_to_float(float_to_max_keys(row, dtype))
    keep = ~np.isnan(stack[0].astype(np.float64))
    assert np.array_equal(row.view(bits.dtype)[keep], bits[keep])


# -- Communicator argument checks (a one-rank loopback) ---------------------------------------

class Loopback(Communicator):
    """One rank: every collective is a copy."""

    def _all_reduce(self, buf, dtype, op, async_op):
        return Handle.completed()

    def _all_gather(self, inp, out, async_op):
        out[...] = inp
        return Handle.completed()

    def _reduce_scatter(self, inp, out, dtype, op, async_op):
        out[...] = inp
        return Handle.completed()

    def _broadcast(self, buf, root, async_op):
        return Handle.completed()

    def _barrier(self):
        pass


def test_base_class_checks_arguments_before_sending():
    comm = Loopback()
    wide = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(wide[:, ::2])
    with pytest.raises(ValueError, match="'sum' or 'max'"):
        comm.all_reduce(np.ones(3, np.float32), op="min")
    with pytest.raises(TypeError, match="reductions support"):
        comm.all_reduce(np.ones(3, np.int16))
    with pytest.raises(TypeError, match="reinterprets"):
        comm.all_reduce(np.ones(3, np.float32), dtype="float16")
    with pytest.raises(ValueError, match="out must have shape"):
        comm.all_gather(np.ones((2, 3), np.float32), out=np.empty((3, 3), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        comm.all_gather(np.ones((2, 3), np.float32), out=np.empty((2, 3), np.float16))
    with pytest.raises(ValueError, match="counts"):
        comm.all_gather_v(np.ones(3, np.float32), [2])
    with pytest.raises(ValueError, match="one non-negative count per rank"):
        comm.all_gather_v(np.ones(3, np.float32), [3, 0])
    with pytest.raises(ValueError, match="root"):
        comm.broadcast(np.ones(3), root=1)
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.all_gather(np.array(1.0, np.float32))
    assert comm.stats.calls == 0


def test_base_class_results_and_counters():
    comm = Loopback()
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    assert np.array_equal(comm.all_gather(strided), strided)  # strided inputs are copied
    handle = comm.all_gather(x, async_op=True)
    assert np.array_equal(handle.wait(), x) and handle.wait() is handle.wait()
    bf = np.ones(5, np.uint16)  # bf16 bit patterns, as CuPy holds them
    assert comm.all_reduce(bf, op="max", dtype="bfloat16") is None
    assert np.array_equal(comm.all_gather_v(x, [12]), x.reshape(-1))
    comm.barrier()
    assert comm.stats.calls == 4 and comm.stats.bytes == 48 + 48 + 10 + 48
    assert comm.stats.meta_calls == 1
    with comm.metadata():
        comm.all_reduce(np.ones(2, np.int64))
    assert comm.stats.calls == 4 and comm.stats.meta_bytes == 16


# -- layouts used by the gather match fb.quantize ----------------------------------------------

@pytest.mark.parametrize("recipe", [fb.Block1D(), fb.Block2D(), fb.MXFP8()])
def test_gather_layouts_match_quantize(recipe, rng):
    for _ in range(6):
        if isinstance(recipe, fb.MXFP8):
            m, k = 32 * int(rng.integers(0, 6)), 32 * int(rng.integers(1, 9))
        else:
            m, k = int(rng.integers(0, 300)), int(rng.integers(1, 300))
        q = fb.quantize(rng.standard_normal((m, k)).astype(np.float32), recipe, True, True)
        buffers = (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data,
                   q.columnwise_scale_inv)
        for buf, (shape, dtype, fill) in zip(buffers, buffer_layouts(recipe, m, k)):
            assert buf.shape == shape and buf.dtype == dtype, (recipe, m, k)


# -- importing needs none of the optional libraries ------------------------------------------

def test_import_without_mpi4py_cupy_torch():
    code = ("import sys\n"
            "for name in ('mpi4py', 'cupy', 'torch'):\n"
            "    sys.modules[name] = None\n"
            "import fp8blk, fp8blk.comm as c\n"
            "assert c.MPIComm and c.NCCLComm and c.TorchComm and c.gather_along_first_dim\n"
            "try:\n"
            "    c.MPIComm()\n"
            "except ImportError:\n"
            "    print('import-ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "import-ok" in result.stdout, result.stderr
