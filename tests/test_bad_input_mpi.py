"""Issue 16, multi-rank: the bad-input cases of tests/comm/mpi_scripts/bad_input_cases.py under
``mpiexec -n 2..4``, with and without ``-m mpi4py`` (one launch runs every case in sequence), and
on in-process thread ranks (fast, no MPI). Each case ends with a clear exception on every rank
or a correct result; none may hang (launcher timeout) or crash inside MPI (exit code)."""
import sys

import pytest

from tests.comm import launch
from tests.comm.mpi_scripts.bad_input_cases import CASES, run_case
from tests.master_scripts.fake_comm import ThreadComm, run_ranks

SCRIPT = launch.SCRIPTS / "bad_input_suite.py"


@pytest.mark.mpi
@pytest.mark.parametrize("with_m", [True, False], ids=["m_mpi4py", "plain"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_bad_input_cases_under_mpiexec(n, with_m):
    pytest.importorskip("mpi4py")
    python = [sys.executable, "-m", "mpi4py"] if with_m else [sys.executable]
    command = launch.mpiexec_command() + ["-n", str(n)] + python + [str(SCRIPT)]
    code, output, seconds = launch.run(command, timeout=150)
    assert code == 0 and launch.suite_passes(output) == n, output[-8000:]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_bad_input_cases_on_thread_ranks(size):
    def body(rank, comm):
        outcomes = []
        for name, fn, expect, min_size, fresh in CASES:
            if size < min_size:
                continue
            if fresh:
                comm = ThreadComm(comm._group, rank)
            outcomes.append(run_case(comm, rank, size, name, fn, expect))
        return outcomes
    failures = [o for per_rank in run_ranks(size, body) for o in per_rank if o != "ok"]
    assert not failures, "\n".join(failures)
