"""Benchmark of the master-weight path on one GPU (bench/README.md method).

    python3 -m bench.bench_master [--out bench/results/master-h200.json] [--quick] [--sweep]

Measures, on a 16384x6144 weight (fp32 master shard covering all of it, and an unaligned shard):
  * the device-to-device copy bandwidth of the same bytes (the limit);
  * the partial-amax and partial-cast kernels alone (back-to-back launches between CUDA events,
    median of many runs, two input sets): achieved bytes/s (master read once + outputs written
    once) and the fraction of the copy bandwidth;
  * MXFP8 cast: the row-only specialization vs the general (columnwise-capable) kernel on the
    same row-only weight, and the bidirectional kernel;
  * the all-reduce payload of one call: E8M0 codes vs what bf16 amaxes would take;
  * a 100-weight batch: kernel launches, memsets, collectives and table uploads per call (must
    equal the 4-weight numbers), and the time per call, GPU and host.
Prints a summary and writes everything as JSON to --out (default
``bench/results/master-<machine>.json``, machine e.g. ``h200``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import fp8blk as fb
from bench import machine
from fp8blk import master
from fp8blk.kernels import partial
from fp8blk.kernels.backend import MasterSettings
from fp8blk.layout import buffer_layouts

BF16 = partial.model_kind(ml_dtypes.bfloat16)  # the launches' model kind of a bf16 model weight

H, W = 16384, 6144
HOST_REPS = 20  # calls timed on the host clock (no synchronization) per batch
BATCH_SIZES = (4, 100)  # weights per batch in the launch-count measurement
BATCH_DIMS = ([1024, 2048, 4096], [1024, 2048, 3072])  # batch weights: (h, w) drawn from these


class LocalComm:
    """World of one: all_reduce is the identity; counts calls and bytes like fp8blk.comm."""

    def __init__(self):
        self.rank, self.size = 0, 1
        self.calls = 0
        self.bytes = 0

    def all_reduce(self, buf, op="max"):
        self.calls += 1
        self.bytes += buf.nbytes


class Counter:
    def __init__(self):
        self.n = 0


def counting(factory, counter):
    """Wrap a kernel factory so every launch of what it returns is counted."""
    def wrapped(*args, **kwargs):
        kernel = factory(*args, **kwargs)

        def launch(*a, **k):
            counter.n += 1
            return kernel(*a, **k)
        return launch
    return wrapped


def gpu_time(cp, fn, reps, inner, warmup=3):
    """Median seconds per fn() over `reps` event-timed runs of `inner` back-to-back calls."""
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3 / inner)
    return statistics.median(times)


def make_weight(cp, recipe, rowwise, columnwise, h=None, w=None):
    """An (h, w) BlockTensor (default H x W) with uninitialized CuPy buffers of the docs/layouts.md
    layouts."""
    h, w = h or H, w or W
    bufs = [None if layout is None else cp.empty(layout.shape, layout.dtype)
            for layout in buffer_layouts(recipe, h, w, rowwise, columnwise)]
    return fb.BlockTensor((h, w), recipe, *bufs, dtype=np.float32, family="cupy")


def masters_for(cp, seed, n):
    """A flat fp32 master shard of n elements on the GPU."""
    return cp.random.default_rng(seed).standard_normal(n, dtype=np.float32) * cp.float32(3.0)


def kernel_rows(cp, copy_bw, reps, inner, only=None, aligned_only=False):
    """Bandwidth of the partial kernels alone on the 16384x6144 weight (cases whose label is
    in `only`, default all)."""
    rows = []
    total = H * W
    cases = [
        ("Block2D", fb.Block2D(fb.E4M3, False), True, False),
        ("Block2D+transposed col", fb.Block2D(fb.E4M3, False), True, True),
        ("MXFP8 row-only", fb.MXFP8(fb.E4M3), True, False),
        ("MXFP8 bidirectional", fb.MXFP8(fb.E4M3), True, True),
    ]
    shards = (("aligned", 0, total), ("unaligned o=3", 3, total - 8))
    for label, recipe, row, col in cases:
        if only is not None and label not in only:
            continue
        for shard_label, o, n in shards[:1] if aligned_only else shards:
            weight = make_weight(cp, recipe, row, col)
            times_amax, times_cast = [], []
            for seed in (1, 2):  # two input sets
                m = masters_for(cp, seed, n)
                items, _ = master.validate([weight], [m], [o], None)
                batch = partial.Batch(items, have_fragments=False)
                buf = batch.new_buffer()
                times_amax.append(gpu_time(
                    cp, lambda: partial.launch_partial_amax(batch, buf, BF16), reps, inner))
                scales = partial.launch_scales(batch, buf, 3.3895313892515355e38)
                sbuf = scales if batch.block2d else buf
                times_cast.append(gpu_time(
                    cp, lambda: partial.launch_cast(batch, sbuf, BF16), reps, inner))
            t_amax, t_cast = statistics.median(times_amax), statistics.median(times_cast)
            amax_bytes = 4 * n + batch.buf_entries * buf.itemsize
            out_bytes = n * (int(row) + int(col))  # FP8 bytes written per direction
            cast_bytes = 4 * n + out_bytes
            rows.append({"case": label, "shard": shard_label, "elements": n,
                         "amax_us": t_amax * 1e6, "amax_TBps": amax_bytes / t_amax / 1e12,
                         "amax_frac_copy": amax_bytes / t_amax / copy_bw,
                         "cast_us": t_cast * 1e6, "cast_TBps": cast_bytes / t_cast / 1e12,
                         "cast_frac_copy": cast_bytes / t_cast / copy_bw})
            print(f"  {label:24s} {shard_label:14s} amax {t_amax * 1e6:8.1f} us "
                  f"{amax_bytes / t_amax / 1e12:5.2f} TB/s ({amax_bytes / t_amax / copy_bw:4.0%})"
                  f"   cast {t_cast * 1e6:8.1f} us {cast_bytes / t_cast / 1e12:5.2f} TB/s "
                  f"({cast_bytes / t_cast / copy_bw:4.0%})", flush=True)
    return rows


def specialization_rows(cp, reps, inner):
    """MXFP8 cast: row-only specialization vs the general kernel on the same row-only weight,
    and the bidirectional weight (general kernel), 16384x6144, aligned."""
    n = H * W
    m = masters_for(cp, 3, n)
    out = {}
    for label, col, force_general in (("row-only weight, row-only kernel", False, False),
                                      ("row-only weight, general kernel", False, True),
                                      ("bidirectional weight, general kernel", True, False)):
        weight = make_weight(cp, fb.MXFP8(fb.E4M3), True, col)
        items, _ = master.validate([weight], [m], [0], None)
        batch = partial.Batch(items, have_fragments=False)
        buf = batch.new_buffer()
        partial.launch_partial_amax(batch, buf, BF16)
        partial.launch_scales(batch, buf, 0.0)
        if force_general:
            for ln in batch.cast_launches:
                ln.with_col = True  # HASCOL = 0 in the table: the runtime branch skips it
        out[label] = gpu_time(cp, lambda: partial.launch_cast(batch, buf, BF16), reps,
                              inner) * 1e6
        print(f"  {label:40s} {out[label]:8.1f} us", flush=True)
    return out


def batch_rows(cp, reps):
    """Launches and time per call for a 4-weight and a 100-weight batch (Block2D with and
    without columnwise, MXFP8 bidirectional and row-only, in turn; the one rank owns every
    weight whole)."""
    counters = {"amax": Counter(), "scale": Counter(), "cast": Counter()}
    partial.amax_kernel = counting(partial.amax_kernel, counters["amax"])
    partial.scale_kernel = counting(partial.scale_kernel, counters["scale"])
    partial.cast_kernel = counting(partial.cast_kernel, counters["cast"])
    result = {}
    rng = np.random.default_rng(7)
    recipes = [(fb.Block2D(fb.E4M3, True), True, False), (fb.MXFP8(fb.E4M3), True, True),
               (fb.MXFP8(fb.E4M3), True, False), (fb.Block2D(fb.E4M3, False), True, True)]
    for n_weights in BATCH_SIZES:
        shapes = [(int(rng.choice(BATCH_DIMS[0])), int(rng.choice(BATCH_DIMS[1])))
                  for _ in range(n_weights)]
        weights = [make_weight(cp, *recipes[i % 4], h=s[0], w=s[1])
                   for i, s in enumerate(shapes)]
        # one rank owns every element (cast_master_weights rejects shards that leave part of a
        # weight unwritten, and with one rank its shard is the whole weight)
        masters, starts = [], []
        for h, w in shapes:
            size = h * w
            starts.append(0)
            masters.append(masters_for(cp, 5, size))
        comm = LocalComm()

        def call():
            master.cast_master_weights(weights, masters, starts, comm)
        call()  # compile
        cp.cuda.get_current_stream().synchronize()
        for c in counters.values():
            c.n = 0
        uploads = partial.counters["tables_uploaded"]
        comm.calls = comm.bytes = 0
        call()
        launches = {k: c.n for k, c in counters.items()}
        calls, payload = comm.calls, comm.bytes
        uploads_steady = partial.counters["tables_uploaded"] - uploads
        t_gpu = gpu_time(cp, call, reps, 5, warmup=1)
        t0 = time.perf_counter()
        for _ in range(HOST_REPS):
            call()
        t_host = (time.perf_counter() - t0) / HOST_REPS
        cp.cuda.get_current_stream().synchronize()
        owned = sum(int(m.size) for m in masters)
        result[n_weights] = {"kernel_launches": launches,
                             "total_kernel_launches": sum(launches.values()),
                             "memsets": len({type(x.recipe) for x in weights}),
                             "collectives": calls, "payload_bytes": payload,
                             "table_uploads_steady_state": uploads_steady,
                             "owned_elements": owned, "gpu_us_per_call": t_gpu * 1e6,
                             "host_us_per_call": t_host * 1e6}
        print(f"  {n_weights:3d} weights: launches {launches} (total "
              f"{sum(launches.values())}), collectives {calls}, payload {payload} B, table "
              f"uploads {uploads_steady}, {t_gpu * 1e6:.0f} us/call GPU, "
              f"{t_host * 1e6:.0f} us/call host", flush=True)
    return result


def payload_rows():
    """All-reduce payload of one call, from the packed-buffer layout (no GPU needed)."""
    tiles = -(-H // 128) * -(-W // 128)
    mx_row, mx_col = H * (W // 32), (H // 32) * W
    return {"Block2D fp32 tile amaxes": 4 * tiles,
            "MXFP8 bidirectional E8M0 codes": mx_row + mx_col,
            "MXFP8 bidirectional as bf16 amaxes": 2 * (mx_row + mx_col),
            "MXFP8 row-only E8M0 codes": mx_row,
            "MXFP8 row-only as bf16 amaxes": 2 * mx_row}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the MXFP8 fast-path kernels under other register caps")
    args = ap.parse_args()
    import cupy as cp

    reps, inner = (5, 5) if args.quick else (25, 10)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    info = {"device": props["name"].decode() if isinstance(props["name"], bytes)
            else props["name"], "python": platform.python_version(), "numpy": np.__version__,
            "cupy": cp.__version__}
    try:
        import numba_cuda
        info["numba_cuda"] = getattr(numba_cuda, "__version__", "?")
    except ImportError:
        pass
    print(f"device: {info['device']}", flush=True)

    nbytes = H * W * 4
    src = cp.random.default_rng(0).standard_normal(H * W, dtype=np.float32)
    dst = cp.empty_like(src)
    t_copy = gpu_time(cp, lambda: cp.copyto(dst, src), reps, inner)
    copy_bw = 2 * nbytes / t_copy
    print(f"copy {nbytes / 1e6:.0f} MB: {t_copy * 1e6:.1f} us, {copy_bw / 1e12:.2f} TB/s "
          f"(read + write)", flush=True)
    src = dst = None  # free the copy buffers

    print("partial kernels alone (16384x6144, fp32 master, bf16 model):", flush=True)
    kernels = kernel_rows(cp, copy_bw, reps, inner)
    sweep = {}
    if args.sweep:
        saved = partial.use_settings(MasterSettings())
        for min_blocks in (3, 4):
            sweep_settings = MasterSettings(amax_fast_min_blocks_mxfp8=min_blocks,
                                                cast_fast_min_blocks_mxfp8=min_blocks)
            partial.use_settings(sweep_settings)
            print(f"MXFP8 fast-path kernels with minBlocksPerSM={min_blocks}:", flush=True)
            sweep[min_blocks] = kernel_rows(cp, copy_bw, reps, inner, aligned_only=True,
                                            only=("MXFP8 row-only", "MXFP8 bidirectional"))
        partial.use_settings(saved)
    print("MXFP8 cast specialization (16384x6144, aligned):", flush=True)
    spec = specialization_rows(cp, reps, inner)
    payload = payload_rows()
    print("all-reduce payload per call (16384x6144):", flush=True)
    for k, v in payload.items():
        print(f"  {k:38s} {v:>10d} B", flush=True)
    print("batches (every weight owned whole by the one rank, mixed recipes):", flush=True)
    batches = batch_rows(cp, reps)
    results = {"info": info, "copy": {"bytes": 2 * nbytes, "us": t_copy * 1e6,
                                      "TBps": copy_bw / 1e12},
               "kernels": kernels, "mxfp8_min_blocks_sweep": sweep,
               "mxfp8_cast_specialization_us": spec,
               "payload_bytes": payload, "batches": batches,
               "command": "python3 -m bench.bench_master " + " ".join(sys.argv[1:])}
    out = args.out or os.path.join("bench", "results", f"master-{machine(info['device'])}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
