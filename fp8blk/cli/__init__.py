"""The command line, ``python -m fp8blk demo|bench|info|prebuild``: one module per subcommand
(``demo``, ``demo_distributed``, ``bench``, ``info``, ``prebuild``), argparse value types in
``args``. Each subcommand module registers its parser (``add_parser``) with ``run(args) -> exit
status`` and optionally ``check(args) -> usage error or None``, called before any work: every
input error is a one-line usage message with exit status 2.
"""
from __future__ import annotations

import argparse
import sys

from .args import positive_int, seed

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
    def run(args):
        from .info import run as run_info

        return run_info(args)
    p = sub.add_parser("info", help="versions and GPU availability",
                       description="Versions, and whether a GPU is usable: if not, why and "
                                   "which extra to install.")
    p.set_defaults(run=run)
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
