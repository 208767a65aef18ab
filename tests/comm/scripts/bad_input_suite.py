"""Under real MPI: every multi-rank bad-input case of bad_input_cases.py, in sequence,
on fp8blk.comm.MPIComm. Each case must end with the expected exception on every rank or a
correct result; a hang is caught by the launcher's timeout, a crash inside MPI by the exit code.

    mpiexec -n 3 python -m mpi4py -m tests.comm.scripts.bad_input_suite
    mpiexec -n 3 python -m tests.comm.scripts.bad_input_suite      # without mpi4py's -m too

Every rank prints "SUITE OK" when all its cases passed; rank 0 prints every rank's failures.
"""
import sys

from mpi4py import MPI

from fp8blk.comm.mpi import MPIComm
from tests.comm.scripts.bad_input_cases import CASES, run_case


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
