"""One-GPU checks of the quantized gather over NCCLComm (world size 1, started without
mpiexec: mpi4py's singleton), on CuPy and torch CUDA inputs: bytes equal ``quantize`` of the
input, ``out=`` reuse, a communication ``stream=``, asynchronous handles, and
``NCCLComm.all_gather``'s direct pointer path. Run on the H200 with
``python3 -m pytest -m gpu tests/comm/gather/test_gpu.py -q``."""
import numpy as np
import pytest

import fp8blk as fb

from tests.comm.gather.checks import assert_same_bytes, gather_input

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def comm():
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    return fb.comm.NCCLComm.from_mpi(MPI.COMM_SELF)


def _host(buf):
    if buf is None:
        return None
    if hasattr(buf, "cpu"):  # torch
        return buf.cpu().numpy()
    import cupy

    return cupy.asnumpy(buf)


CASES = [(fb.Block1D(), True, False, 300, 1000), (fb.Block1D(), True, True, 256, 1024),
         (fb.MXFP8(), True, False, 96, 512), (fb.Block2D(), False, True, 200, 640)]


@pytest.mark.parametrize("family", ["cupy", "torch"])
@pytest.mark.parametrize("recipe,rowwise,columnwise,rows,k", CASES)
def test_one_rank_gather_is_quantize(comm, family, recipe, rowwise, columnwise, rows, k, rng):
    import cupy

    host = gather_input(rng, rows, k)
    if family == "torch":
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(host).cuda().to(torch.bfloat16)
    else:
        x = cupy.asarray(host)
    expected = fb.quantize(x, recipe, rowwise, columnwise)
    comm.reset_stats()
    out, handle = fb.comm.gather_along_first_dim(x, comm, recipe, rowwise, columnwise)
    assert handle is None and comm.stats.meta_calls == 0
    assert_same_bytes(out, expected, _host)
    # out= reused on a side stream, asynchronously; then synchronously on the current one
    side = cupy.cuda.Stream(non_blocking=True)
    for step in range(3):
        host = gather_input(rng, rows, k)
        x = torch.from_numpy(host).cuda().to(torch.bfloat16) if family == "torch" \
            else cupy.asarray(host)
        expected = fb.quantize(x, recipe, rowwise, columnwise)
        again, handle = fb.comm.gather_along_first_dim(
            x, comm, recipe, rowwise, columnwise, out=out, sizes=[rows],
            async_op=step < 2, stream=side if step == 1 else None)
        assert again is out
        if handle is not None:
            assert handle.wait() is out
        assert_same_bytes(out, expected, _host)


def test_all_gather_direct_path(comm, rng):
    import cupy

    torch = pytest.importorskip("torch")
    host = rng.integers(0, 255, (64, 33), dtype=np.uint8)
    for x in (cupy.asarray(host), torch.from_numpy(host).cuda()):
        comm.reset_stats()
        out = comm.all_gather(x)
        assert np.array_equal(_host(out), host) and comm.stats.calls == 1
        target = out * 0
        assert comm.all_gather(x, out=target) is target
        assert np.array_equal(_host(target), host)
    bf = torch.from_numpy(rng.standard_normal((8, 16)).astype(np.float32)).cuda().bfloat16()
    assert torch.equal(comm.all_gather(bf), bf)


def test_plain_gather_torch_stays_torch(comm, rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal(77).astype(np.float32)).cuda().bfloat16()
    out, _ = fb.comm.gather_along_first_dim(x, comm)
    assert isinstance(out, torch.Tensor) and out.is_cuda and torch.equal(out, x)
    side = torch.cuda.Stream()
    target = torch.empty_like(x)
    got, handle = fb.comm.gather_along_first_dim(x, comm, out=target, async_op=True,
                                                 stream=side)
    assert handle.wait() is target and got is target and torch.equal(target, x)
