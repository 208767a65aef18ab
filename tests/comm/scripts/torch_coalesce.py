"""TorchComm's quantized gather on gloo: ONE torch collective per gather of several parts (its
parts packed), the same bytes as ``quantize`` of the whole, and one collective per part with
``coalesce_limit = 0``. The in-band status of these sizes= gathers is one more part, 8 bytes
per rank: packed with the others, or, beside a single part (which keeps its in-place gather),
a collective of its own. The collectives are counted by a shim around torch.distributed's
gather functions (what TorchComm calls).

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 tests/comm/scripts/torch_coalesce.py
"""
import collections
import datetime
import warnings

import numpy as np
import torch
import torch.distributed as dist

import fp8blk as fb
from fp8blk.comm import GatherFallbackWarning, TorchComm

COUNTED = ("all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast")
calls = collections.Counter()


def count(name):
    inner = getattr(dist, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return inner(*args, **kwargs)
    setattr(dist, name, counted)


def shard(rng, rows, k):
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-4, 4, (rows, 1))
    return x.astype(np.float32)


def same_bytes(got, want, label):
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                 "columnwise_scale_inv"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), (label, name)
        if w is not None:
            g = g.numpy() if isinstance(g, torch.Tensor) else np.asarray(g)
            assert np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)), (label, name)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for name in COUNTED:
        if hasattr(dist, name):
            count(name)
    comm = TorchComm()
    n, me = comm.size, comm.rank
    cases = [  # recipe, rows per rank, rowwise, columnwise, input kind, parts
        (fb.Block1D(), [128] * n, True, False, "torch", 2),
        (fb.Block1D(), [128 * (1 + r % 2) for r in range(n)], True, True, "torch", 4),
        (fb.MXFP8(), [64 + 32 * (r % 2) for r in range(n)], True, True, "numpy", 4),
        (fb.Block2D(), [128] * n, True, True, "torch", 2),
        (fb.Block1D(), [128] * n, True, True, "block", 4),
        (fb.Block1D(), [100 + 28 * (r % 2) for r in range(n)], True, True, "block", 2),
        (fb.Block1D(), [100 + 28 * (r % 2) for r in range(n)], True, True, "torch", 1),
    ]
    for limit in (TorchComm.coalesce_limit, 0):
        comm.coalesce_limit = limit
        for case, (recipe, rows, rowwise, columnwise, kind, parts) in enumerate(cases):
            label = (f"case {case} {recipe} rows {rows} {kind} limit {limit}")
            rng = np.random.default_rng([case, 7])
            for step in range(3):
                every = [shard(rng, r, 256) for r in rows]
                if kind == "block":  # the last rank lacks columnwise: the fallback keeps rowwise
                    held = [fb.quantize(x, recipe, True, columnwise and (
                        r < n - 1 or rows[0] % 128 == 0)) for r, x in enumerate(every)]
                    x = held[me]
                    full = np.concatenate(every)
                    want = fb.quantize(full, recipe, rowwise, columnwise)
                else:
                    x = torch.from_numpy(every[me]) if kind == "torch" else every[me]
                    want = fb.quantize(np.concatenate(every), recipe, rowwise, columnwise)
                comm.reset_stats()
                calls.clear()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", GatherFallbackWarning)
                    out, handle = fb.comm.gather_along_first_dim(
                        x, comm, None if kind == "block" else recipe, rowwise, columnwise,
                        async_op=step == 2, sizes=rows)
                if handle is not None:
                    handle.wait()
                if kind == "block" and comm.stats.last_gather_path == "fallback":
                    # the kept rowwise: the ranks' bytes; columnwise derived (other tests)
                    assert np.array_equal(np.asarray(out.rowwise_data).view(np.uint8),
                                          want.rowwise_data.view(np.uint8)), label
                else:
                    same_bytes(out, want, label)
                if step == 0:
                    continue  # the first call exchanges metadata
                assert comm.stats.meta_calls == 0, (label, comm.stats)
                issued = sum(calls.values())
                expected = (1 if parts > 1 else 2) if limit else parts + 1  # + the status
                assert issued == expected, (label, dict(calls), expected)
    dist.barrier()
    print(f"SUITE OK torch coalesce rank {me}/{n}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
