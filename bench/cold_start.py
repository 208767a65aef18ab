"""Cold start of fp8blk's kernels with the compiled-kernel cache (fp8blk/kernels/_cache.py).

    python3 -m bench.cold_start --out DIR_OR_FILE.json [--ranks 4] [--jobs 16] [--launcher procs]

Steps, each in fresh processes, on one GPU:
  1. ``python -m fp8blk prebuild`` into an empty cache folder: variants, time.
  2. warm cache (3 fresh processes): time of ``import fp8blk``, of CUDA context creation, of
     the first ``fb.quantize`` of a prebuilt variant (CuPy fp32 4096x4096, Block1D row+col,
     host time to the synchronized result) and of the second call; whether numba was imported.
     Target: first call <= 0.1 s beyond the context.
  3. the same with ``FP8BLK_KERNEL_CACHE=0`` (every process compiles): the cost the cache saves.
  4. an empty cache folder shared by ``--ranks`` processes started at once under ``mpiexec``
     (or as plain processes with ``--launcher procs``): each runs quantize / dequantize /
     transpose on the same data (8 variants); every variant must be compiled exactly once
     (the cache's builds.log) and every rank must get identical cubins and output bytes.
Writes JSON (machine, date, command, per-step figures; host times only: nothing here is
GPU-bound).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- child processes --------------------------------------------------------------------------


def child_warm():
    """One fresh process: timings of the first fb.quantize with whatever cache the env says."""
    t0 = time.perf_counter()
    import numpy as np
    import cupy
    t_cupy = time.perf_counter() - t0
    t0 = time.perf_counter()
    import fp8blk as fb
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    cupy.cuda.runtime.free(0)               # creates the primary context
    cupy.cuda.Device().synchronize()
    t_ctx = time.perf_counter() - t0
    x = cupy.asarray(np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32))
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fb.quantize(x, fb.Block1D(), rowwise=True, columnwise=True)
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    from fp8blk.kernels import backend
    return {"import_numpy_cupy_s": t_cupy, "import_fp8blk_s": t_import, "context_s": t_ctx,
            "first_quantize_s": times[0], "second_quantize_s": times[1],
            "first_beyond_second_s": times[0] - times[1],
            "numba_imported": "numba" in sys.modules, **backend.cache_counts()}


def child_rank(outdir):
    """One rank of step 4: outputs and cubin hashes of 8 variants into outdir/rank-N.json."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get(
        "PMI_RANK", os.environ.get("FP8BLK_BENCH_RANK", "0"))))
    import numpy as np
    import cupy

    import fp8blk as fb
    from fp8blk.kernels import backend as kernels
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1024, 1024)) * np.exp(rng.uniform(-6, 6, (1024, 1)))).astype(
        np.float32)
    xd = cupy.asarray(x)
    t0 = time.perf_counter()
    out = {}
    for name, recipe in (("b1d", fb.Block1D()), ("b2d", fb.Block2D()), ("mx", fb.MXFP8())):
        bufs = kernels.quantize(xd, recipe, True, True)
        out["q-" + name] = [hashlib.sha256(b.get().tobytes()).hexdigest() for b in bufs]
        y = kernels.dequantize(recipe, (1024, 1024), bufs[0], bufs[1], dtype=np.float32)
        out["dq-" + name] = hashlib.sha256(y.get().tobytes()).hexdigest()
    d, s, _, _ = kernels.quantize(xd, fb.Block2D(), True, False)
    t = kernels.block2d_columnwise_from_rowwise(d, s)
    out["tr"] = [hashlib.sha256(b.get().tobytes()).hexdigest() for b in t]
    cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    cc = cupy.cuda.Device().compute_capability
    cubins = {name: cubin and hashlib.sha256(cubin).hexdigest()
              for name, cubin in kernels.loaded_cubins((int(cc[:-1]), int(cc[-1]))).items()}
    res = {"rank": rank, "outputs": out, "cubins": cubins,
           "builds": kernels.cache_counts()["builds"],
           "seconds": seconds, "numba_imported": "numba" in sys.modules}
    with open(os.path.join(outdir, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)


# ---- driver -------------------------------------------------------------------------------------


def run_child(args, env):
    proc = subprocess.run([sys.executable, "-m", "bench.cold_start"] + args, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def base_env(cache_dir, cache_on=True):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FP8BLK_CACHE_DIR=cache_dir, FP8BLK_KERNEL_CACHE="1" if cache_on else "0")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def log(*a):
    print(*a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="JSON file to write, or a folder to write it in")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=None, help="prebuild processes")
    ap.add_argument("--launcher", choices=("mpiexec", "procs"), default="mpiexec")
    ap.add_argument("--mpiexec", default="mpiexec --allow-run-as-root --oversubscribe",
                    help="mpiexec command line (before -n)")
    ap.add_argument("--child", choices=("warm", "rank"))
    ap.add_argument("--outdir")
    args = ap.parse_args()
    if args.child == "warm":
        print(json.dumps(child_warm()))
        return 0
    if args.child == "rank":
        child_rank(args.outdir)
        return 0

    work = tempfile.mkdtemp(prefix="fp8blk-cold-")
    res = {"machine": platform.node(), "date": datetime.datetime.now().isoformat(),
           "command": " ".join(sys.argv), "python": sys.version.split()[0]}
    try:
        import cupy
        res["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as exc:
        res["gpu"] = f"unavailable: {exc!r}"
    ok = True

    # 1. prebuild
    cache = os.path.join(work, "prebuilt")
    cmd = [sys.executable, "-m", "fp8blk", "prebuild", "--dir", cache]
    if args.jobs:
        cmd += ["--jobs", str(args.jobs)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=base_env(cache), capture_output=True, text=True, cwd=ROOT)
    res["prebuild"] = {"seconds": time.perf_counter() - t0, "rc": proc.returncode,
                       "summary": proc.stdout.strip().splitlines()[-1:],
                       "cubins": len(glob.glob(os.path.join(cache, "*.cubin")))}
    log("prebuild:", res["prebuild"])
    ok &= proc.returncode == 0

    # 2. / 3. fresh processes, warm cache and no cache
    for label, on in (("warm_cache", True), ("no_cache", False)):
        runs = [run_child(["--child", "warm"], base_env(cache, on)) for _ in range(3)]
        beyond = [r["first_quantize_s"] for r in runs]
        res[label] = {"runs": runs,
                      "median_context_s": statistics.median(r["context_s"] for r in runs),
                      "median_first_quantize_s": statistics.median(beyond),
                      "median_import_fp8blk_s": statistics.median(r["import_fp8blk_s"]
                                                                  for r in runs)}
        log(label, {k: v for k, v in res[label].items() if k != "runs"})
    warm = res["warm_cache"]
    res["target_first_call_le_0.1s"] = warm["median_first_quantize_s"] <= 0.1
    res["warm_numba_imported"] = any(r["numba_imported"] for r in warm["runs"])
    ok &= not res["warm_numba_imported"]

    # 4. ranks racing on an empty cache
    shared = os.path.join(work, "shared")
    outdir = os.path.join(work, "ranks")
    os.makedirs(outdir)
    env = base_env(shared)
    child = [sys.executable, "-m", "bench.cold_start", "--child", "rank", "--outdir", outdir]
    t0 = time.perf_counter()
    if args.launcher == "mpiexec" and shutil.which(args.mpiexec.split()[0]):
        proc = subprocess.run(args.mpiexec.split() + ["-n", str(args.ranks)] + child, env=env,
                              capture_output=True, text=True, timeout=900)
        rcs = [proc.returncode]
        launcher = args.mpiexec
    else:
        procs = [subprocess.Popen(child, env=dict(env, FP8BLK_BENCH_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r in range(args.ranks)]
        rcs = [p.wait(timeout=900) for p in procs]
        launcher = "procs"
    wall = time.perf_counter() - t0
    ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(outdir, "rank-*.json")))]
    log_lines = [json.loads(line) for line in open(os.path.join(shared, "builds.log"))] \
        if os.path.exists(os.path.join(shared, "builds.log")) else []
    per_digest = {}
    for line in log_lines:
        per_digest[line["digest"]] = per_digest.get(line["digest"], 0) + 1
    same_out = len({json.dumps(r["outputs"], sort_keys=True) for r in ranks}) == 1
    same_cubins = len({json.dumps(r["cubins"], sort_keys=True) for r in ranks}) == 1
    res["ranks"] = {"launcher": launcher, "n": args.ranks, "returncodes": rcs,
                    "ranks_reported": len(ranks), "wall_s": wall,
                    "variants": len(ranks[0]["cubins"]) if ranks else 0,
                    "builds_total": len(log_lines),
                    "builds_per_variant_max": max(per_digest.values()) if per_digest else 0,
                    "builds_by_rank": [r["builds"] for r in ranks],
                    "seconds_by_rank": [r["seconds"] for r in ranks],
                    "identical_outputs": same_out, "identical_cubins": same_cubins}
    log("ranks:", res["ranks"])
    ok &= (len(ranks) == args.ranks and same_out and same_cubins and per_digest
           and max(per_digest.values()) == 1 and len(per_digest) == res["ranks"]["variants"])
    res["ok"] = bool(ok)
    if args.out:
        path = args.out
        if os.path.isdir(path) or path.endswith(os.sep):   # a folder: name the file
            path = os.path.join(path, f"cold-start-{machine(res['gpu'])}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    log("OK" if ok else "FAILED", "->", path if args.out else "(no --out)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
