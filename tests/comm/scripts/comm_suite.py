"""Run the communicator suite under mpiexec.

    mpiexec -n N python -m mpi4py -m tests.comm.scripts.comm_suite BACKEND [PARTS]

BACKEND: ``mpi`` (MPIComm, NumPy arrays), ``mpi-cupy`` (MPIComm with CuPy arrays staged
through host memory), ``nccl`` (NCCLComm on CuPy arrays; one rank per GPU). PARTS: a comma list
of collectives,packed,gather,plain,sizes,dispatch (default: all; gather includes plain). Each
rank prints ``SUITE OK ...`` when it passes.

On the GPU machine (system Open MPI, not CUDA-aware)::

    /usr/bin/mpiexec --allow-run-as-root --oversubscribe -n 1 \\
        python3 -m mpi4py -m tests.comm.scripts.comm_suite nccl
    /usr/bin/mpiexec --allow-run-as-root --oversubscribe -n 2 \\
        python3 -m mpi4py -m tests.comm.scripts.comm_suite mpi-cupy
"""
import os
import sys

from mpi4py import MPI

from fp8blk.comm import MPIComm, NCCLComm
from tests.comm.scripts import checks


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "mpi"
    parts = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else \
        ("collectives", "packed", "gather", "dispatch")
    if backend == "mpi":
        comm, family = MPIComm(MPI.COMM_WORLD), checks.Family()
    elif backend == "mpi-cupy":
        import cupy

        cupy.cuda.Device(0).use()
        comm, family = MPIComm(MPI.COMM_WORLD), checks.CupyFamily()
        assert not comm.cuda_aware or os.environ.get("FP8BLK_MPI_CUDA_AWARE") == "1"
    elif backend == "nccl":
        comm = NCCLComm.from_mpi(MPI.COMM_WORLD)
        family = checks.CupyFamily()
    else:
        raise SystemExit(f"unknown backend {backend!r}")
    checks.run_suite(comm, family, backend, parts)


if __name__ == "__main__":
    main()
