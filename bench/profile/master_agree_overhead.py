"""Host cost of cast_master_weights' rank agreement in the steady state, on the CPU.

    python3 -m bench.profile.master_agree_overhead [N_WEIGHTS ...]

Times, per call, with N weights (host buffers): the call's validation (master.validate) and
what the agreement adds on a hit: building this rank's batch key, comparing it with the
prediction, appending the (cached) header to the first bucket's packed buffer and checking the
reduced header (an identity all-reduce stands in for the collective). Prints microseconds
per call; compare with the per-call host time of bench/bench_master.py (H200: ~200 us for 4
weights, ~1040 us for 100). World size 1 skips the agreement entirely.

Last result (the 2-core CPU machine, 2026-12-01): 4 weights: validate 47.1 us, the agreement
alone 5.1 us per call (1.28 us per weight).
"""
import sys
import time

import numpy as np

import fp8blk as fb
from fp8blk import master
from fp8blk.master import agree
from fp8blk.master.items import MODEL_DTYPES
from fp8blk.layout import buffer_layouts


class IdentityComm:
    rank, size = 0, 2

    def all_reduce(self, buf, op="max"):
        pass


def weights_and_masters(n, rng):
    ws, ms, starts = [], [], []
    for i in range(n):
        recipe = fb.Block2D() if i % 2 else fb.MXFP8()
        h, w = (256, 512) if i % 3 else (512, 256)
        bufs = [None if l is None else np.zeros(l.shape, l.dtype)
                for l in buffer_layouts(recipe, h, w, True, i % 2 == 0)]
        ws.append(fb.BlockTensor((h, w), recipe, *bufs))
        ms.append(rng.standard_normal(h * w // 2).astype(np.float32))
        starts.append(h * w // 4)
    return ws, ms, starts


def best_us(fns, reps=20, rounds=40):
    """Per function, the best mean over `rounds` runs of `reps` calls, the functions
    interleaved round by round (the machine's load drifts; the best run is the least
    disturbed)."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / reps)
    return [b * 1e6 for b in best]


def main(sizes):
    rng = np.random.default_rng(0)
    for n in sizes:
        ws, ms, starts = weights_and_masters(n, rng)
        items, on_device = master.validate(ws, ms, starts, None)
        batch = agree.local_batch(items, MODEL_DTYPES[1], on_device)
        predicted = agree.Config(12345, batch.key, batch.first())
        packed = np.zeros(predicted.first[2], predicted.first[1])
        comm = IdentityComm()

        def before():
            master.validate(ws, ms, starts, None)

        def after():
            its, dev = master.validate(ws, ms, starts, None)
            b = agree.local_batch(its, MODEL_DTYPES[1], dev)
            assert b.key == predicted.key
            agree.HeaderedComm(comm, predicted).all_reduce(packed)

        def agreement_only():
            b = agree.local_batch(items, MODEL_DTYPES[1], on_device)
            assert b.key == predicted.key
            agree.HeaderedComm(comm, predicted).all_reduce(packed)

        t_before, t_after, t_agree = best_us([before, after, agreement_only])
        print(f"{n:4d} weights: validate {t_before:8.1f} us, validate + agreement "
              f"{t_after:8.1f} us; the agreement alone {t_agree:6.1f} us per call "
              f"({t_agree / n:.2f} us per weight; packed buffer {packed.nbytes} B)", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 100])
