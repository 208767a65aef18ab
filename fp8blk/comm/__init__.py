"""Collectives for fp8blk (MPI, NCCL, torch process groups). See docs/distributed.md.

    comm = fb.comm.MPIComm(MPI.COMM_WORLD)          # or NCCLComm.from_mpi(), TorchComm(group)
    comm.all_reduce(amax, op="max")                  # in place
    fb.comm.packed_all_reduce(comm, [a, b, c], "max")    # three arrays, one collective
    out, _ = fb.comm.gather_along_first_dim(x, comm, fb.Block1D())   # quantized all-gather
    q, recv_counts, _ = fb.comm.quantized_all_to_all(rows, comm, send_counts)  # MoE dispatch

Importing this package needs neither mpi4py, CuPy nor torch: each backend imports its library
when it is constructed.
"""
from .base import Communicator, Handle, Stats
from .dispatch import high_precision_all_to_all, quantized_all_to_all
from .gather import GatherFallbackWarning, gather_along_first_dim
from .mpi import MPIComm
from .nccl import NCCLComm
from .packed import packed_all_gather, packed_all_reduce
from .torch_pg import TorchComm

__all__ = ["Communicator", "Handle", "Stats", "MPIComm", "NCCLComm", "TorchComm",
           "gather_along_first_dim", "GatherFallbackWarning", "packed_all_reduce",
           "packed_all_gather", "quantized_all_to_all", "high_precision_all_to_all"]
