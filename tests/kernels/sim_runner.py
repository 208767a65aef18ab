"""Runs every kernel under the Numba CUDA simulator on tiny grids and compares its bytes with
the reference. Started by test_sim.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (the variable
must be set before numba is imported, so these cases cannot share a process with tests that
import numba normally). Prints one JSON object {case: null | error message}.

Usage, from the repository root: NUMBA_ENABLE_CUDASIM=1 python -m tests.kernels.sim_runner SEED
"""
import json
import os
import sys
import traceback
import warnings

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
# The simulator runs a block's 256 threads as Python threads, and its manager thread polls
# them in a busy loop. With Python's default 5 ms switch interval a case can stall for
# minutes (seen: a 256-thread Block2D case taking 3 s or >100 s on the same data, 3 runs in
# 4 over 100 s); with 10 ms it took 3.7-4.5 s in 7 runs of 7 (50 ms: 9-11 s).
sys.setswitchinterval(0.01)

import numpy as np  # noqa: E402

from fp8blk import reference as ref  # noqa: E402
from fp8blk.kernels.quantize import quantize as kquantize  # noqa: E402
from fp8blk.kernels.quantize import quantize_group  # noqa: E402
from fp8blk.kernels.dequantize import dequantize as kdq  # noqa: E402
from fp8blk.kernels.transpose import block2d_columnwise_from_rowwise as ktr  # noqa: E402
from tests._same import same_bytes  # noqa: E402
from tests.kernels._cases import DTYPES, RECIPES, make_input, plant_fp8_specials  # noqa: E402
from fp8blk.kernels import rms_norm, silu_gate  # noqa: E402
from fp8blk.kernels.weighted_rows import weighted_rows  # noqa: E402
from tests.kernels._silu_gate_checks import gate_reference, gate_rows  # noqa: E402
from tests.kernels._weighted_rows_checks import rows_case, rows_reference  # noqa: E402
from tests.kernels._rms_norm_checks import check_backward, check_forward, make_rows  # noqa: E402
from tests.kernels.sim_cases import (DEQUANT_CASES, GROUP_CASES,  # noqa: E402
                                     QUANTIZE_CASES, RMS_NORM_CASES, SILU_GATE_CASES,
                                     TRANSPOSE_CASES, WEIGHTED_ROWS_CASES, group_name)

def run(seed):
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(seed)
    results = {}

    def case(name, fn):
        try:
            results[name] = fn()
        except Exception:  # report, do not stop the other cases
            results[name] = traceback.format_exc(limit=4)

    for rname, dname, rw, cw, shape in QUANTIZE_CASES:
        def q(rname=rname, dname=dname, rw=rw, cw=cw, shape=shape):
            x = make_input(rng, shape, DTYPES[dname])
            arg = x.view(np.uint16) if dname == "bf16" else x
            got = kquantize(arg, RECIPES[rname], rw, cw, dtype=DTYPES[dname])
            want = ref.quantize(x, RECIPES[rname], rw, cw)
            errs = [same_bytes(g, w) for g, w in zip(got, want)]
            errs = [f"buffer {i}: {e}" for i, e in enumerate(errs) if e]
            return "; ".join(errs) or None
        case(f"quantize-{rname}-{dname}-r{int(rw)}c{int(cw)}-{shape[0]}x{shape[1]}", q)

    for parts in GROUP_CASES:
        def grp(parts=parts):
            xs = [make_input(rng, sh, DTYPES[d]) for _, d, _, _, sh in parts]
            got = quantize_group([(x.view(np.uint16) if d == "bf16" else x, RECIPES[r], rw, cw,
                                   DTYPES[d]) for x, (r, d, rw, cw, _) in zip(xs, parts)])
            errs = [f"part {p} buffer {i}: {e}"
                    for p, (x, (r, _, rw, cw, _), bufs) in enumerate(zip(xs, parts, got))
                    for i, (g, w) in enumerate(zip(bufs, ref.quantize(x, RECIPES[r], rw, cw)))
                    if (e := same_bytes(g, w))]
            return "; ".join(errs) or None
        case(group_name(parts), grp)

    for rname, cw, oname, shape in DEQUANT_CASES:
        def dq(rname=rname, cw=cw, oname=oname, shape=shape):
            x = make_input(rng, shape, np.float32)
            bufs = plant_fp8_specials(rng, ref.quantize(x, RECIPES[rname], not cw, cw),
                                      RECIPES[rname])
            got = kdq(RECIPES[rname], shape, *bufs, dtype=DTYPES[oname])
            return same_bytes(got, ref.dequantize(RECIPES[rname], shape, *bufs,
                                                  dtype=DTYPES[oname]))
        case(f"dequantize-{rname}-c{int(cw)}-{oname}-{shape[0]}x{shape[1]}", dq)

    for shape in TRANSPOSE_CASES:
        def tr(shape=shape):
            x = make_input(rng, shape, np.float32)
            data, sinv, _, _ = ref.quantize(x, RECIPES["b2d"], True, False)
            want = ref.block2d_columnwise_from_rowwise(data, sinv)
            out = (np.zeros_like(want[0]), np.zeros_like(want[1]))
            got = ktr(data, sinv, out=out)
            if got[0] is not out[0] or got[1] is not out[1]:
                return "out buffers not reused"
            errs = [same_bytes(g, w) for g, w in zip(got, want)]
            return "; ".join(e for e in errs if e) or None
        case(f"transpose-{shape[0]}x{shape[1]}", tr)

    for m, d, dname in RMS_NORM_CASES:
        def norm(m=m, d=d, dname=dname):
            dt = DTYPES[dname]
            st = (lambda a: a.view(np.uint16)) if dname == "bf16" else (lambda a: a)
            x, dy = make_rows(rng, m, d, dt), make_rows(rng, m, d, dt, spread=2.0)
            x[1, d // 3] = np.inf
            x[2] = 0
            w = (1 + 0.3 * rng.standard_normal(d)).astype(np.float32).astype(dt)
            y, r = rms_norm.forward(st(x), st(w), 1e-5, dtype=dt)
            err = check_forward(x, w, 1e-5, y.view(dt), r)
            if err:
                return "forward: " + err
            dx, dw_part = rms_norm.backward(st(x), st(w), st(dy), r, dtype=dt)
            err = check_backward(x, w, dy, r, dx.view(dt), dw_part)
            return err and "backward: " + err
        case(f"rms_norm-{dname}-{m}x{d}", norm)

    for m, i, dname in SILU_GATE_CASES:
        def gate(m=m, i=i, dname=dname):
            dt = DTYPES[dname]
            g, u, dp = gate_rows(rng, m, i, dt)
            want = gate_reference(g, u, dp, lambda v: np.exp(v.astype(np.float64)))
            st = [a.view(np.uint16) for a in (g, u, dp)]
            got = [silu_gate.forward(st[0], st[1], dtype=dt)]
            dg, du = np.empty_like(st[0]), np.empty_like(st[0])
            silu_gate.backward(*st, dg, du, dtype=dt)
            errs = [f"{n}: {e}" for n, a, w in zip(("p", "dg", "du"), got + [dg, du], want)
                    if (e := same_bytes(a.view(dt), w))]
            return "; ".join(errs) or None
        case(f"silu_gate-{dname}-{m}x{i}", gate)

    for t, k, h, r, dname in WEIGHTED_ROWS_CASES:
        def rows(t=t, k=k, h=h, r=r, dname=dname):
            dt = DTYPES[dname]
            src, w, pairs = rows_case(rng, t, k, h, r, dt)
            got = weighted_rows(src.view(np.uint16), w, pairs, k, dtype=dt)
            return same_bytes(got.view(dt), rows_reference(src, w, pairs, k))
        case(f"weighted_rows-{dname}-{t}x{k}x{h}-{r}", rows)
    return results


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]))))
