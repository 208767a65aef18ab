"""Issue 16 under real MPI: every multi-rank bad-input case of bad_input_cases.py, in sequence,
on fp8blk.comm.MPIComm. Each case must end with the expected exception on every rank or a
correct result; a hang is caught by the launcher's timeout, a crash inside MPI by the exit code.

    mpiexec -n 3 python -m mpi4py tests/comm/mpi_scripts/bad_input_suite.py
    mpiexec -n 3 python tests/comm/mpi_scripts/bad_input_suite.py      # without -m mpi4py too

Every rank prints "SUITE OK" when all its cases passed; rank 0 prints every rank's failures.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

from mpi4py import MPI  # noqa: E402

from fp8blk.comm.mpi import MPIComm  # noqa: E402
from tests.comm.mpi_scripts.bad_input_cases import CASES, run_case  # noqa: E402


def main():
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = MPIComm(world)
    failures, ran = [], 0
    for name, fn, expect, min_size, fresh in CASES:
        if size < min_size:
            continue
        if fresh:
            comm = MPIComm(world)
        outcome = run_case(comm, rank, size, name, fn, expect)
        ran += 1
        if outcome != "ok":
            failures.append(outcome)
    everyone = world.allgather(failures)
    if rank == 0:
        for lines in everyone:
            for line in lines:
                print("FAIL", line, flush=True)
    print(f"rank {rank}: {ran} cases" + ("" if failures else ", SUITE OK"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
