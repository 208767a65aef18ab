"""Benchmark of the fp8blk GPU kernels against the copy limit and peers, in one process.

    python3 -m bench.bench_kernels --out DIR [--quick] [--no-peers]

Measures, on bf16 inputs at 8192x8192, 16384x16384 and 8191x8320 (MXFP8: 8192x8320):
  * each quantize / transpose / dequantize kernel: median time of back-to-back calls through
    ``fp8blk.kernels`` (allocation included; host cost hides behind the kernel at these sizes),
    with CUDA events, several rotating input sets; bytes = inputs read once + outputs written
    once; reported as TB/s and as a fraction of the device-to-device copy measured in the run;
  * peers on the same inputs (16384x16384): torch.compile of the same formula, and torchao
    0.18's Triton kernels (act_quant_lhs, act_quant_transposed_lhs, weight_quant_rhs,
    weight_quant_transposed_rhs) where they exist;
  * host microseconds per ``fp8blk.quantize`` call on 256x256 arrays (CuPy fp32, torch bf16).
Writes DIR/kernels-<machine>.json (machine, date, command, per-case figures; machine e.g.
``h200``) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import cupy
import ml_dtypes
import numpy as np

import fp8blk as fb
from bench import machine
from fp8blk.cli import timing
from fp8blk.kernels import backend as kernels
from fp8blk.kernels import quantize as quant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = np.dtype(ml_dtypes.bfloat16)

RESULTS = {"cases": [], "peers": [], "host_us": {}, "notes": []}


def log(*a):
    print(*a, flush=True)


# -------------------------------------------------------------------------------------------
# timing


def time_cupy(fn, inputs, reps=7, inner=10):
    """(median seconds per call, all figures) of fn(inp) over back-to-back calls, rotating
    `inputs` (fp8blk.cli.timing.time_cupy without its host figure)."""
    gpu, _, times = timing.time_cupy(fn, inputs, reps, inner)
    return gpu, times


def time_torch(fn, inputs, reps=7, inner=10):
    gpu, _, times = timing.time_torch(fn, inputs, reps, inner)
    return gpu, times


def copy_bandwidth(nbytes, reps=9):
    src = cupy.empty(nbytes, dtype=np.uint8)
    src[...] = 1
    dst = cupy.empty_like(src)

    def fn(_):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3,
                                      cupy.cuda.get_current_stream().ptr)
    t, ts = time_cupy(fn, [None], reps=reps, inner=10)
    return 2 * nbytes / t, t


# -------------------------------------------------------------------------------------------
# inputs and byte counts


def bf16_inputs(shape, n=3, seed=0):
    """n device bf16 arrays (uint16 bits) of random data, made on the GPU."""
    out = []
    for i in range(n):
        rs = cupy.random.RandomState(seed + i)
        x = rs.standard_normal(shape, dtype=np.float32) * np.float32(3.0)
        out.append((x.view(np.uint32) >> 16).astype(np.uint16))  # truncate to bf16 bits
    return out


def out_bytes(bufs):
    return sum(int(b.nbytes) for b in bufs if b is not None)


KERNEL_CASES = [
    # name, recipe, rowwise, columnwise
    ("b1d_row", fb.Block1D(), True, False),
    ("b1d_col", fb.Block1D(), False, True),
    ("b1d_both", fb.Block1D(), True, True),
    ("b2d_row", fb.Block2D(), True, False),
    ("b2d_both", fb.Block2D(), True, True),
    ("mx_row", fb.MXFP8(), True, False),
    ("mx_col", fb.MXFP8(), False, True),
    ("mx_both", fb.MXFP8(), True, True),
]


def bench_ours(shapes, copy_bps):
    for shape in shapes:
        inputs = bf16_inputs(shape)
        for name, recipe, rw, cw in KERNEL_CASES:
            s = shape
            if isinstance(recipe, fb.MXFP8) and s[0] % 32:
                s = (s[0] // 32 * 32 + 32, s[1])
                xs = bf16_inputs(s)
            else:
                xs = inputs
            bufs = kernels.quantize(xs[0], recipe, rw, cw, dtype=BF16)
            nbytes = xs[0].nbytes + out_bytes(bufs)
            t, ts = time_cupy(lambda x: kernels.quantize(x, recipe, rw, cw, dtype=BF16), xs)
            add_case(name, s, t, nbytes, copy_bps, ts)
        # Block2D FP8 transpose (create_columnwise), reusing the output buffers
        rd, rs_, _, _ = kernels.quantize(inputs[0], fb.Block2D(), True, False, dtype=BF16)
        datas = [rd] + [kernels.quantize(x, fb.Block2D(), True, False, dtype=BF16)[0]
                        for x in inputs[1:]]
        out = kernels.block2d_columnwise_from_rowwise(rd, rs_)
        nbytes = rd.nbytes + rs_.nbytes + out_bytes(out)
        t, ts = time_cupy(lambda d: kernels.block2d_columnwise_from_rowwise(d, rs_, out=out),
                          datas)
        add_case("b2d_transpose", shape, t, nbytes, copy_bps, ts)
        # dequantize to bf16 from each recipe's rowwise and columnwise buffers
        for name, recipe in (("b1d", fb.Block1D()), ("b2d", fb.Block2D()), ("mx", fb.MXFP8())):
            s = shape if not isinstance(recipe, fb.MXFP8) else (-(-shape[0] // 32) * 32,
                                                                -(-shape[1] // 32) * 32)
            x = inputs[0] if s == shape else bf16_inputs(s, n=1)[0]
            qd = kernels.quantize(x, recipe, True, True, dtype=BF16)
            for direction, bufs in (("row", qd[:2] + (None, None)),
                                    ("col", (None, None) + qd[2:])):
                held = [b for b in bufs if b is not None]
                nbytes = out_bytes(held) + x.nbytes
                t, ts = time_cupy(lambda b: kernels.dequantize(recipe, s, *b, dtype=BF16),
                                  [bufs])
                add_case(f"{name}_dequant_{direction}_bf16", s, t, nbytes, copy_bps, ts)
            del qd, x
        del inputs
        cupy.get_default_memory_pool().free_all_blocks()


def add_case(name, shape, t, nbytes, copy_bps, ts=None, kind="ours"):
    rec = {"case": name, "shape": list(shape), "kind": kind, "seconds": t, "bytes": nbytes,
           "tb_s": nbytes / t / 1e12, "frac_copy": nbytes / t / copy_bps,
           "all_seconds": ts}
    (RESULTS["cases"] if kind == "ours" else RESULTS["peers"]).append(rec)
    log(f"  {kind:10s} {name:24s} {str(tuple(shape)):16s} {t * 1e6:9.1f} us "
        f"{nbytes / t / 1e12:6.2f} TB/s {100 * nbytes / t / copy_bps:5.1f}% of copy")


def _func_attr(fn, code):
    """cuFuncGetAttribute(code) of a CuPy Function (4 regs, 1 static shared, 3 local)."""
    try:
        return int(cupy.cuda.driver.funcGetAttribute(code, fn.ptr))
    except Exception as exc:
        return repr(exc)[:60]


def kernel_attributes():
    """Registers / shared / local bytes of every compiled quantize kernel (CuPy Function)."""
    out = {}
    for fn, spec in quant.loaded_kernels():
        name = f"{spec.recipe}-k{spec.kind}-r{int(spec.rowwise)}c{int(spec.columnwise)}" \
               f"-v{int(spec.vec)}{int(spec.col_vec)}"
        out[name] = {a: _func_attr(fn, code) for a, code in
                     (("num_regs", 4), ("shared_size_bytes", 1), ("local_size_bytes", 3))}
        log("  attrs", name, out[name])
    return out


def bench_variants(copy_bps, shape=(16384, 16384)):
    """Re-time the slower kernels with a minimum-CTAs-per-SM launch bound (register cap)."""
    from fp8blk.kernels.quantize import use_settings
    from fp8blk.kernels.backend import QuantizeSettings
    xs = bf16_inputs(shape)
    saved = use_settings(QuantizeSettings())
    for min_blocks in (2, 3, 4):
        use_settings(QuantizeSettings(min_blocks_per_sm=min_blocks))  # drops kernels and plans
        for name, recipe, rw, cw in KERNEL_CASES:
            if name not in ("b1d_col", "b1d_both", "mx_both", "mx_col"):
                continue
            try:
                bufs = kernels.quantize(xs[0], recipe, rw, cw, dtype=BF16)
                nbytes = xs[0].nbytes + out_bytes(bufs)
                t, ts = time_cupy(lambda x: kernels.quantize(x, recipe, rw, cw, dtype=BF16), xs)
                add_case(name, shape, t, nbytes, copy_bps, ts, kind=f"minblk{min_blocks}")
                fn = quant.loaded_kernels()[0][0]
                RESULTS["variant_regs"] = RESULTS.get("variant_regs", {})
                RESULTS["variant_regs"][f"{name}-minblk{min_blocks}"] = _func_attr(fn, 4)
            except Exception as exc:
                RESULTS["notes"].append(f"variant {name} minblk{min_blocks}: {exc!r}")
                log("  variant failed", name, min_blocks, repr(exc)[:200])
            use_settings(QuantizeSettings(min_blocks_per_sm=min_blocks))  # one case's kernel
    use_settings(saved)


# -------------------------------------------------------------------------------------------
# peers (torch.compile of the same formulas, torchao 0.18 Triton kernels)


def torch_formulas():
    """The torch formulas of ``fp8blk.cli.timing`` (one copy for both benchmarks), without its
    fused ``b1d_both``: this table compares torch.compile with single directions."""
    return {k: v for k, v in timing.torch_formulas().items() if k != "b1d_both"}


def bench_peers(shape, copy_bps, ours):
    import torch

    xs_cp = bf16_inputs(shape)
    xs = [torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16) for x in xs_cp]
    nb_in = xs[0].numel() * 2

    def nbytes_of(outs):
        return nb_in + sum(o.numel() * o.element_size() for o in outs)

    # torchao Triton kernels
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as tk

        peers = {"b1d_row": tk.triton_fp8_blockwise_act_quant_lhs,
                 "b1d_col": tk.triton_fp8_blockwise_act_quant_transposed_lhs,
                 "b2d_row": tk.triton_fp8_blockwise_weight_quant_rhs,
                 "b2d_col": tk.triton_fp8_blockwise_weight_quant_transposed_rhs}
        for name, fn in peers.items():
            try:
                nb = nbytes_of(fn(xs[0]))
                t, ts = time_torch(fn, xs)
                add_case(name, shape, t, nb, copy_bps, ts, kind="torchao")
            except Exception as exc:  # report and go on
                RESULTS["notes"].append(f"torchao {name}: {exc!r}")
                log("  torchao", name, "failed:", repr(exc)[:300])
        # torchao has no fused row+col Block1D kernel: its cost is the two kernels back to back
        try:
            for name, row_fn, col_fn in (
                    ("b1d_both", tk.triton_fp8_blockwise_act_quant_lhs,
                     tk.triton_fp8_blockwise_act_quant_transposed_lhs),
                    ("b2d_both", tk.triton_fp8_blockwise_weight_quant_rhs,
                     tk.triton_fp8_blockwise_weight_quant_transposed_rhs)):
                def both(x, row_fn=row_fn, col_fn=col_fn):
                    return row_fn(x), col_fn(x)
                outs = both(xs[0])
                nb = nbytes_of([*outs[0], *outs[1]])
                t, ts = time_torch(both, xs)
                add_case(name, shape, t, nb, copy_bps, ts, kind="torchao")
        except Exception as exc:
            RESULTS["notes"].append(f"torchao both: {exc!r}")
    except Exception as exc:
        RESULTS["notes"].append(f"torchao import failed: {exc!r}")
        log("torchao import failed:", repr(exc)[:300])

    # torch.compile of the same formulas
    formulas = torch_formulas()
    for name, fn in formulas.items():
        try:
            t0 = time.time()
            cfn = torch.compile(fn, dynamic=False)
            if name == "b2d_transpose":
                d_in = [kernels.quantize(x, fb.Block2D(), True, False, dtype=BF16)[0]
                        for x in xs_cp]
                args = [torch.from_dlpack(d) for d in d_in]
                nb = 2 * args[0].numel()
            else:
                args = xs
                nb = nbytes_of(cfn(xs[0]))
            cfn(args[0])
            log(f"  torch.compile {name}: compiled in {time.time() - t0:.0f} s")
            t, ts = time_torch(cfn, args)
            add_case(name, shape, t, nb, copy_bps, ts, kind="compile")
        except Exception as exc:
            RESULTS["notes"].append(f"torch.compile {name}: {exc!r}")
            log("  torch.compile", name, "failed:", repr(exc)[:300])


# -------------------------------------------------------------------------------------------
# host cost and the NaN probe


def host_cost(n=3000):
    import torch

    out = {}
    x32 = cupy.random.standard_normal((256, 256), dtype=np.float32)
    xt = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    xbits = cupy.asarray(x32.view(np.uint32) >> 16).astype(np.uint16)
    rec = fb.Block1D()
    cases = {
        "fb.quantize cupy f32 256x256 Block1D row": lambda: fb.quantize(x32, rec),
        "fb.quantize cupy f32 256x256 Block1D row+col":
            lambda: fb.quantize(x32, rec, rowwise=True, columnwise=True),
        "fb.quantize torch bf16 256x256 Block1D row": lambda: fb.quantize(xt, rec),
        "fb.quantize cupy f32 256x256 MXFP8 row": lambda: fb.quantize(x32, fb.MXFP8()),
        "fb.quantize cupy f32 256x256 MXFP8 row+col":
            lambda: fb.quantize(x32, fb.MXFP8(), rowwise=True, columnwise=True),
        "kernels.quantize cupy bf16 256x256 Block1D row":
            lambda: kernels.quantize(xbits, rec, True, False, dtype=BF16),
        "kernels.quantize cupy f32 256x256 Block1D row":
            lambda: kernels.quantize(x32, rec, True, False),
        "cupy.empty x2 (allocation alone)":
            lambda: (cupy.empty((256, 256), np.uint8), cupy.empty((2, 256), np.float32)),
    }
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        cupy.cuda.Device().synchronize()
        best = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            cupy.cuda.Device().synchronize()
            best.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = statistics.median(best)
        # the minimum is the path's cost; median - minimum is the host's noise in this run
        out[name + " [min of 7]"] = min(best)
        # GPU time of one call on its own (events around each call): a host figure close to
        # it means the loop was GPU-bound, not host-bound
        from cupyx.profiler import benchmark
        gpu = float(np.median(benchmark(fn, n_repeat=500, n_warmup=50).gpu_times)) * 1e6
        out[name + " [GPU us per call alone]"] = gpu
        log(f"  host {name:50s} {out[name]:7.1f} us/call, min {min(best):5.1f} "
            f"(GPU alone {gpu:6.1f} us)")
    return out


# -------------------------------------------------------------------------------------------


def write(path):
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)


def table():
    log("\n=== summary (bf16 input; frac = achieved / device copy in this run) ===")
    log(f"copy: {RESULTS['copy_tb_s']:.2f} TB/s")
    peers = {}
    for p in RESULTS["peers"]:
        peers.setdefault(p["case"], {})[p["kind"]] = p["seconds"]
    for c in RESULTS["cases"]:
        extra = ""
        if tuple(c["shape"]) == (16384, 16384) and c["case"] in peers:
            extra = "  speedup vs " + ", ".join(f"{k} {v / c['seconds']:.2f}x"
                                                for k, v in peers[c["case"]].items())
        log(f"{c['case']:22s} {str(tuple(c['shape'])):15s} {c['seconds'] * 1e6:8.1f} us "
            f"{c['tb_s']:5.2f} TB/s {100 * c['frac_copy']:5.1f}%{extra}")
    for k, v in RESULTS["host_us"].items():
        log(f"host: {k:50s} {v:6.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--quick", action="store_true", help="16384x16384 only")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--host-only", action="store_true", help="host cost per call only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    path = os.path.join(args.out, f"kernels-{machine(props['name'])}.json")
    RESULTS.update({
        "machine": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "sms": props["multiProcessorCount"], "date": date,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "host": platform.node(), "versions": {}})
    for mod in ("numpy", "numba", "numba_cuda", "cupy", "torch", "triton", "torchao"):
        try:
            RESULTS["versions"][mod] = __import__(mod).__version__
        except Exception as exc:
            RESULTS["versions"][mod] = repr(exc)[:80]
    log("versions", RESULTS["versions"])
    if args.host_only:
        RESULTS["host_us"] = host_cost()
        write(path.replace(".json", "-host.json"))
        return
    copy_bps, _ = copy_bandwidth(16384 * 16384 * 2)
    RESULTS["copy_tb_s"] = copy_bps / 1e12
    log(f"device copy: {copy_bps / 1e12:.3f} TB/s")
    shapes = [(16384, 16384)] if args.quick else [(16384, 16384), (8192, 8192), (8191, 8320)]
    bench_ours(shapes, copy_bps)
    RESULTS["kernel_attributes"] = kernel_attributes()
    write(path)
    if not args.no_variants:
        bench_variants(copy_bps)
        write(path)
    RESULTS["host_us"] = host_cost()
    write(path)
    if not args.no_peers:
        ours = {c["case"]: c["seconds"] for c in RESULTS["cases"]
                if tuple(c["shape"]) == (16384, 16384)}
        bench_peers((16384, 16384), copy_bps, ours)
        write(path)
    # fused Block1D row+col against our separate row and col kernels
    c = {x["case"]: x["seconds"] for x in RESULTS["cases"] if tuple(x["shape"]) == (16384, 16384)}
    if {"b1d_row", "b1d_col", "b1d_both"} <= c.keys():
        RESULTS["b1d_fused_vs_separate"] = (c["b1d_row"] + c["b1d_col"]) / c["b1d_both"]
        log(f"Block1D fused row+col vs separate: {RESULTS['b1d_fused_vs_separate']:.2f}x")
    write(path)
    table()
    log("wrote", path)


if __name__ == "__main__":
    main()
