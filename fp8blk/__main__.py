"""``python -m fp8blk demo|bench|info|prebuild``.

demo   quantize random matrices with every recipe (on the GPU when CuPy sees one, else on the
       CPU) and print, per recipe, bytes stored, dequantization error and time; with
       --distributed, under mpiexec: quantized all-gather and master-weight casts over MPI.
bench  GPU: kernel bandwidth over sizes vs copy, torch.compile, torchao (--out DIR: JSON + PNG);
       CPU: the reference path's timings (8192x8192 float32 by default).
info   versions and whether a GPU is usable.
prebuild  compile the common kernel variants into fp8blk's kernel cache (fp8blk/_prebuild.py).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import fp8blk as fb


def _gpu_module():
    """CuPy if it is installed and sees a device, else None."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


RECIPES = [
    ("Block1D E4M3", fb.Block1D(fb.E4M3)),
    ("Block2D E4M3", fb.Block2D(fb.E4M3)),
    ("MXFP8 E4M3", fb.MXFP8(fb.E4M3)),
    ("Block1D E5M2", fb.Block1D(fb.E5M2)),
]


def _nbytes(q):
    total = 0
    for buf in (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv):
        if buf is not None:
            total += buf.nbytes
    return total


def demo(args) -> int:
    if args.distributed:
        from ._demo_distributed import run

        return run(args.seed)
    xp = np if args.cpu else (_gpu_module() or np)
    where = "GPU (CuPy)" if xp is not np else "CPU (NumPy reference)"
    rows, cols = args.shape
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


def info(args) -> int:
    import ml_dtypes

    print(f"fp8blk {fb.__version__}, python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}")
    for name in ("numba", "numba_cuda", "cupy", "mpi4py", "torch"):
        try:
            module = __import__(name)
            print(f"  {name:<11}{getattr(module, '__version__', '?')}")
        except Exception as exc:  # optional dependencies
            print(f"  {name:<11}not available ({type(exc).__name__})")
    print(f"  GPU        {'yes' if _gpu_module() else 'no'}")
    return 0


def _positive_int(text):
    """argparse type: an int >= 1 (a clear usage error instead of a traceback later)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8blk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="quantize random matrices with every recipe")
    p_demo.add_argument("--shape", type=_positive_int, nargs=2, default=(2048, 2048),
                        metavar=("M", "K"), help="matrix shape, both >= 1 (MXFP8 runs when "
                        "both are multiples of 32)")
    p_demo.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    p_demo.add_argument("--seed", type=_seed, default=0)
    p_demo.add_argument("--distributed", action="store_true",
                        help="the multi-rank part; run under `mpiexec -n N python -m mpi4py -m fp8blk`")
    from . import _bench  # the bench subcommand lives in fp8blk/_bench.py

    _bench.add_arguments(sub.add_parser("bench", help="kernel bandwidth table and plot (GPU), "
                                        "reference-path timings (CPU)"))
    sub.add_parser("info", help="versions and GPU availability")
    from ._prebuild import add_parser as add_prebuild  # prebuild: compile kernels ahead
    add_prebuild(sub)
    args = parser.parse_args(argv)
    if args.command == "prebuild":
        return args.run(args)
    return {"demo": demo, "bench": _bench.run, "info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
