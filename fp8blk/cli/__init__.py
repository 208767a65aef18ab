"""The command line, ``python -m fp8blk demo|bench|info|prebuild`` (docs/api.md, Command line):
the parser, the argparse value types and the GPU probe the subcommands share, and ``info``.
``demo``, ``bench`` (over ``timing``) and ``prebuild`` are modules of their own. Each subcommand
sets ``run(args) -> exit status`` and optionally ``check(args) -> usage error or None``, called
before any work: every input error is a one-line usage message with exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

DESCRIPTION = """\
FP8 block-scaled quantization (Block1D, Block2D, MXFP8), byte for byte as TransformerEngine.

subcommands:
  demo      quantize a random matrix with every recipe (on the GPU when the kernels can run
            there, else on the CPU): bytes stored, dequantization error, time; with
            --distributed, under mpiexec: quantized all-gather and master-weight casts over MPI
  bench     GPU: kernel bandwidth over sizes against a device copy, torch.compile and torchao;
            CPU: the reference path's timings (--out DIR writes JSON and a plot)
  info      versions, and whether a GPU is usable (if not, why and what to install)
  prebuild  compile the common kernel variants into fp8blk's kernel cache
"""
GPU_EXTRA = "pip install 'fp8blk[gpu]'"


# -- argparse value types: a bad value is a usage error (exit 2, one line) --------------------


def _int_at_least(low, expected):
    """An argparse type: an int >= `low`, `expected` naming it in the error."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")
seed = _int_at_least(0, "an integer >= 0")


def writable_dir(path, option):
    """A message when folder `path` cannot be made or written (for `option`), else None."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{option} {path}: cannot write there ({exc.strerror or exc})"
    return None


# -- the GPU probe, and ``info`` ------------------------------------------------------------


def probe_gpu():
    """(cupy or None, why not, compute capability (major, minor) or None): the kernels run when
    CuPy is installed, a CUDA driver answers and it sees a device of compute capability 8.9 or
    newer. `why not` is "" when they do."""
    try:
        import cupy
    except ImportError:
        return None, f"CuPy is not installed ({GPU_EXTRA})", None
    except Exception as exc:  # a broken CuPy install (missing CUDA libraries)
        return None, f"CuPy does not import: {type(exc).__name__}: {exc} ({GPU_EXTRA})", None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorNoDevice, cudaErrorInsufficientDriver, no libcuda
        text = str(exc)
        if "NoDevice" in text or "no CUDA-capable device" in text:
            return None, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)", None
        return None, (f"no usable CUDA driver ({type(exc).__name__}: {text}); install the "
                      f"NVIDIA driver"), None
    if count < 1:
        return None, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)", None
    from ..kernels.backend import MIN_CC

    cc_text = cupy.cuda.Device().compute_capability
    cc = (int(cc_text[:-1]), int(cc_text[-1]))
    if cc < MIN_CC:
        return None, (f"the GPU has compute capability {cc[0]}.{cc[1]}; the kernels need "
                      f"{MIN_CC[0]}.{MIN_CC[1]} or newer (sm_89, sm_90, sm_100, sm_120)"), cc
    return cupy, "", cc


def gpu_module():
    """CuPy if the kernels can run on its current device, else None."""
    return probe_gpu()[0]


def run_info(args) -> int:
    """The ``info`` subcommand: versions, and whether a GPU is usable."""
    import ml_dtypes
    import numpy as np

    import fp8blk as fb

    print(f"fp8blk {fb.__version__}, python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}")
    for name in ("numba", "numba_cuda", "cupy", "mpi4py", "torch"):
        try:
            module = __import__(name)
            print(f"  {name:<11}{getattr(module, '__version__', '?')}")
        except Exception as exc:  # optional dependencies
            print(f"  {name:<11}not available ({type(exc).__name__})")
    cupy, why, cc = probe_gpu()
    if cupy is not None:
        print(f"  GPU        yes: {_device_name(cupy)}, compute capability {cc[0]}.{cc[1]}")
    else:
        print(f"  GPU        no: {why}; fp8blk runs on the CPU (NumPy reference)")
    return 0


def _device_name(cupy):
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# -- the parser -----------------------------------------------------------------------------


def _demo_check(args):
    if args.distributed:
        if args.shape is not None:
            return ("--shape applies to the single-process demo; the distributed demo runs "
                    "fixed shapes (drop --shape)")
        return None
    if args.shape is not None:
        from .demo import check_shape

        return check_shape(args.shape, args.cpu)
    return None


def _add_demo(sub):
    p = sub.add_parser("demo", help="quantize a random matrix with every recipe",
                       description="Quantize a random (M, K) float32 matrix with every recipe "
                                   "and print bytes stored, dequantization error and time.")
    p.add_argument("--shape", type=positive_int, nargs=2, default=None, metavar=("M", "K"),
                   help="matrix shape, both >= 1, default 2048 2048 (MXFP8 runs when both are "
                        "multiples of 32); refused when it would not fit in memory")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--distributed", action="store_true",
                   help="the multi-rank part, on fixed shapes; run under "
                        "`mpiexec -n N python -m mpi4py -m fp8blk demo --distributed`")

    def run(args):
        from .demo import run as run_demo

        return run_demo(args)
    p.set_defaults(run=run, check=_demo_check)
    return p


def _add_info(sub):
    p = sub.add_parser("info", help="versions and GPU availability",
                       description="Versions, and whether a GPU is usable: if not, why and "
                                   "which extra to install.")
    p.set_defaults(run=run_info)
    return p


def parser():
    """The argparse parser of ``python -m fp8blk``."""
    from . import bench, prebuild

    top = argparse.ArgumentParser(prog="python -m fp8blk", description=DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    for add in (_add_demo, bench.add_parser, _add_info, prebuild.add_parser):
        p = add(sub)
        p.set_defaults(parser=p)  # for usage errors found after parsing
    return top


def main(argv=None) -> int:
    """Parse `argv` (default ``sys.argv[1:]``), check it, run the subcommand; returns its exit
    status (argparse's SystemExit(2) for a usage error)."""
    top = parser()
    args = top.parse_args(argv)
    check = getattr(args, "check", None)
    problem = check(args) if check is not None else None
    if problem:
        args.parser.error(problem)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
