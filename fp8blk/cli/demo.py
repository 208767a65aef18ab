"""``python -m fp8blk demo``: quantize a random matrix with every recipe (on the GPU when the
kernels can run there, else on the CPU) and print, per recipe, bytes stored, dequantization
error and time. ``--distributed`` (under ``mpiexec``): ``demo_distributed``."""
from __future__ import annotations

import os
import time

import numpy as np

import fp8blk as fb

from .info import gpu_module

RECIPES = [
    ("Block1D E4M3", fb.Block1D(fb.E4M3)),
    ("Block2D E4M3", fb.Block2D(fb.E4M3)),
    ("MXFP8 E4M3", fb.MXFP8(fb.E4M3)),
    ("Block1D E5M2", fb.Block1D(fb.E5M2)),
]
DEFAULT_SHAPE = (2048, 2048)
# Bytes the demo holds per input element at its peak. Host: the float64 draw, the float32
# input, the dequantized copy and the error arrays (on the CPU also the FP8 copies and the
# reference's temporaries: 36 measured at 2048 x 2048). GPU: the input, the FP8 copies with
# their scales and the dequantized copy.
HOST_BYTES_PER_ELEMENT = 40
GPU_BYTES_PER_ELEMENT = 12


def check_shape(shape, cpu):
    """A usage-error message when an (M, K) float32 demo would not fit in memory (host RAM,
    and the GPU's free memory when it runs there), else None."""
    rows, cols = shape
    needs = [(rows * cols * HOST_BYTES_PER_ELEMENT, _host_available(), "this host has")]
    cupy = None if cpu else gpu_module()
    if cupy is not None:
        needs.append((rows * cols * GPU_BYTES_PER_ELEMENT, cupy.cuda.runtime.memGetInfo()[0],
                      "the GPU has"))
    for need, room, where in needs:
        if room is not None and need > room:
            return (f"--shape {rows} {cols} needs about {need / 2**30:,.1f} GiB; {where} "
                    f"{room / 2**30:,.1f} GiB available: choose a smaller shape")
    return None


def _host_available():
    """Bytes of host memory available now (None where the OS does not say): Linux's
    MemAvailable (free memory plus what the page cache would give back), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _nbytes(q):
    total = 0
    for buf in (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv):
        if buf is not None:
            total += buf.nbytes
    return total


def run(args) -> int:
    if args.distributed:
        from .demo_distributed import run as run_distributed

        return run_distributed(args.seed)
    xp = np if args.cpu else (gpu_module() or np)
    where = "GPU (CuPy)" if xp is not np else "CPU (NumPy reference)"
    rows, cols = args.shape or DEFAULT_SHAPE
    rng = np.random.default_rng(args.seed)
    # Rows of very different magnitudes: what block scaling is for.
    host = (rng.standard_normal((rows, cols)) *
            np.exp(rng.uniform(-2, 2, size=(rows, 1)))).astype(np.float32)
    x = xp.asarray(host)
    print(f"fp8blk {fb.__version__} demo on the {where}: x is {rows}x{cols} float32 "
          f"({host.nbytes / 2**20:.1f} MiB), rowwise + columnwise")
    print(f"{'recipe':<14}{'bytes stored':>14}{'vs fp32':>9}{'max rel err':>13}"
          f"{'rms rel err':>13}{'time ms':>10}")
    for name, recipe in RECIPES:
        if isinstance(recipe, fb.MXFP8) and (rows % 32 or cols % 32):
            print(f"{name:<14}skipped: MXFP8 needs M and K to be multiples of 32")
            continue
        fb.quantize(x, recipe, rowwise=True, columnwise=True)  # warm-up (kernel compilation)
        if xp is not np:
            xp.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        q = fb.quantize(x, recipe, rowwise=True, columnwise=True)
        if xp is not np:
            xp.cuda.runtime.deviceSynchronize()
        elapsed = time.perf_counter() - start
        back = q.dequantize(np.float32)
        back = back.get() if xp is not np else back
        # Relative to each row's amax: the error a block scale promises to bound.
        row_amax = np.abs(host).max(axis=1, keepdims=True)
        rel = np.abs(back - host) / row_amax
        print(f"{name:<14}{_nbytes(q):>14,}{_nbytes(q) / host.nbytes:>9.3f}"
              f"{rel.max():>13.2e}{np.sqrt((rel ** 2).mean()):>13.2e}{elapsed * 1e3:>10.1f}")
    return 0
