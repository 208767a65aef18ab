"""Multi-rank: the bad-input cases of tests/comm/scripts/bad_input_cases.py under
``mpiexec -n 2..4``, with and without ``-m mpi4py`` (one launch runs every case in sequence), and
on in-process thread ranks (fast, no MPI). Each case ends with a clear exception on every rank
or a correct result; none may hang (launcher timeout) or crash inside MPI (exit code)."""
import sys

import pytest

from tests.comm import launch
from tests.comm.scripts.bad_input_cases import CASES, run_case
from tests.master.scripts.fake_comm import ThreadComm, run_ranks

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
                comm = ThreadComm(comm.group, rank)
            outcomes.append(run_case(comm, rank, size, name, fn, expect))
        return outcomes
    failures = [o for per_rank in run_ranks(size, body) for o in per_rank if o != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 3])
def test_gpu_agreement_on_device_buffers(size, rng):
    """The device path through the public entry point: the agreement header rides on the
    first bucket's CuPy all-reduce (and a miss rank's zero buffer is a CuPy one); steady state
    one collective per bucket, a gap after it raises on every rank, then a valid call is
    exact again."""
    import numpy as np

    cp = pytest.importorskip("cupy")
    import fp8blk as fb
    from fp8blk.master import cast_master_weights
    from tests.master.scripts import cases

    specs = [cases.Spec((300, 257), fb.Block2D(fb.E4M3, pow2_scales=False), columnwise=True),
             cases.Spec((128, 96), fb.MXFP8(fb.E5M2), columnwise=True)]
    fulls = [cases.make_full(rng, s.shape) for s in specs]
    ranges = cases.cut_ranges(rng, specs, size)

    def body(rank, comm):
        r = np.random.default_rng([5, rank])
        ws = [cases.alloc_weight(s, r, xp=cp) for s in specs]
        masters, starts = cases.rank_inputs(specs, fulls, ranges, rank, r, xp=cp)
        calls = []
        for _ in range(3):
            comm.reset_stats()
            cast_master_weights(ws, masters, starts, comm)
            calls.append(comm.stats.calls)
        bad = list(masters)
        if rank == size - 1 and bad[1] is not None and bad[1].size > 1:
            bad[1], bad_starts = bad[1][1:], list(starts)
            bad_starts[1] += 1
        else:
            bad_starts = starts
        try:
            cast_master_weights(ws, bad, bad_starts, comm)
            error = None
        except ValueError as exc:
            error = str(exc)
        cast_master_weights(ws, masters, starts, comm)
        return ws, calls, error

    out = run_ranks(size, body)
    cases.check(specs, fulls, ranges, [o[0] for o in out])
    assert all(o[1][1:] == [2, 2] for o in out), [o[1] for o in out]
    shrunk = ranges[1][size - 1][1] > 1
    assert all((o[2] is not None and "uncovered" in o[2]) == shrunk for o in out), out
