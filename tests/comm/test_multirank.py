"""Multi-rank tests: the communicator suite (tests/comm/scripts/checks.py, with the gather's
tests/comm/gather/checks.py and the all-to-alls' tests/comm/dispatch/checks.py in the same
launch) under mpiexec
with MPIComm at 1-4 ranks, on torch ranks (started as torchrun starts them) with TorchComm on
gloo, and jobs whose ranks fail under mpiexec and torchrun (they must end within the timeout,
not hang).

GPU parts (marked ``gpu``; run on the H200 with ``python3 -m pytest -m gpu tests/comm``):
NCCLComm with one rank on CuPy arrays, MPIComm staging CuPy arrays through the host, and
TorchComm on an NCCL process group with CUDA tensors.
"""
import pytest

from .launch import SCRIPTS, mpi, ranks, suite_passes, torchrun

pytestmark = pytest.mark.mpi


def _expect_suite(result, n, runs=1):
    code, output, seconds = result
    assert code == 0 and suite_passes(output) == n * runs, output[-8000:]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mpi_suite(n):
    _expect_suite(mpi(n, "comm_suite.py", "mpi"), n)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("module", [True, False], ids=["m-mpi4py", "plain-python"])
def test_plain_gather_uneven_and_errors(n, module):
    # 1-D inputs, lengths that differ per rank, one rank's invalid input; started
    # without -m mpi4py nothing may hang either
    _expect_suite(mpi(n, "comm_suite.py", "mpi", "plain", timeout=90, mpi4py_module=module), n)


@pytest.mark.parametrize("n", [2, 4])
def test_malformed_sizes_on_one_rank_mpi(n):
    # one rank's sizes= malformed after checked calls: it joins and raises, nobody hangs
    _expect_suite(mpi(n, "comm_suite.py", "mpi", "sizes", timeout=90), n)


@pytest.mark.parametrize("mode", ["between", "inside"])
def test_failing_rank_ends_the_mpi_job(mode):
    code, output, seconds = mpi(3, "fail_in_collective.py", mode, timeout=60)
    assert code != 0, output
    assert "fails on purpose" in output, output
    assert "finished (it should not have)" not in output, output
    assert seconds < 60


@pytest.mark.parametrize("n", [2, 3])
def test_torch_suite_gloo(n):
    # the suite on torch tensors, and its collectives once more on NumPy arrays
    _expect_suite(ranks(n, [SCRIPTS / "torch_suite.py", "gloo"]), n, runs=2)


def test_torch_all_to_all_gloo_4():
    # the all-to-alls' checks at 4 gloo ranks (2 and 3 run them within the whole suite)
    _expect_suite(ranks(4, [SCRIPTS / "torch_suite.py", "gloo", "dispatch"], timeout=180), 4)


def test_torch_gather_one_collective_gloo():
    # TorchComm's quantized gather: its parts packed into one torch collective, same bytes
    _expect_suite(ranks(2, [SCRIPTS / "torch_coalesce.py"], timeout=180), 2)


def test_failing_rank_ends_the_torchrun_job():
    code, output, seconds = torchrun(2, "torch_suite.py", "gloo", timeout=120,
                                     env={"FP8BLK_TEST_FAIL_RANK": "1"})
    assert code != 0 and "fails on purpose" in output, output[-4000:]
    assert "SUITE OK" not in output


def _need_gpus(n):
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count < n:
        pytest.skip(f"needs {n} GPUs, found {count}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_nccl_suite(n):
    _need_gpus(n)
    _expect_suite(mpi(n, "comm_suite.py", "nccl", timeout=600), n)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_mpi_staging_cupy_arrays(n):
    # Open MPI on the GPU machine is not CUDA-aware: device buffers must be staged
    _expect_suite(mpi(n, "comm_suite.py", "mpi-cupy", timeout=600), n)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_torch_suite_nccl(n):
    _need_gpus(n)
    _expect_suite(torchrun(n, "torch_suite.py", "nccl", timeout=600), n)
