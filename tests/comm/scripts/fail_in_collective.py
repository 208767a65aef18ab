"""One rank fails while the others are inside a collective; the job must end, not hang.

    mpiexec -n N python -m mpi4py tests/comm/scripts/fail_in_collective.py MODE

MODE ``between``: rank 1 raises after a first all_reduce while the others enter the next one.
MODE ``inside``: rank 1 raises inside gather_along_first_dim, after the metadata exchange and
before the data all-gather its peers are already waiting in (its local quantize fails).
With ``-m mpi4py`` the uncaught exception aborts every rank.
"""
import sys

import numpy as np
from mpi4py import MPI

import fp8blk as fb
from fp8blk.comm import MPIComm, gather_along_first_dim
from fp8blk.comm.gather import paths

comm = MPIComm(MPI.COMM_WORLD)
mode = sys.argv[1]
buf = np.ones(1000, np.float32)
comm.all_reduce(buf)
if mode == "between" and comm.rank == 1:
    raise RuntimeError("rank 1 fails on purpose between collectives")
if mode == "inside" and comm.rank == 1:
    def failing_quantize(*args, **kwargs):
        raise RuntimeError("rank 1 fails on purpose inside gather_along_first_dim")
    paths.quantize_into = failing_quantize
for _ in range(3):
    comm.all_reduce(buf)
    gather_along_first_dim(np.ones((128, 256), np.float32), comm, fb.Block1D())
print(f"rank {comm.rank} finished (it should not have)", flush=True)
