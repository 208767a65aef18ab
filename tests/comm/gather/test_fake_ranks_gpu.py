"""The quantized gather at 2 and 3 ranks on ONE GPU, for its device fix-up (a
cudaMemcpy2DAsync per rank and staged part, cudaMemsetAsync fills, the 1.0 scale padding
copied from a constant block): ranks are threads of this process, NCCL is a stand-in that
moves the bytes between the ranks' device buffers with cudaMemcpyAsync on the stream the
gather hands it (the same pointers, counts and roots as ncclAllGather / ncclBroadcast), and
the metadata goes through host memory. The result must equal ``fb.quantize`` of the gathered
input byte for byte, for CuPy and torch inputs, equal and unequal shards (an empty one, ones
that are not multiples of 4 rows), on non-default streams, in the steady state (``sizes=``,
the same ``out=`` again) too. Run on the H200 with
``python3 -m pytest -m gpu tests/comm/gather/test_fake_ranks_gpu.py -q``."""
import types

import pytest

import fp8blk as fb
from fp8blk.comm import nccl as nccl_module
from fp8blk.comm.gather import gather_along_first_dim, plan_cache

from tests.comm.fake_ranks import run_ranks
from tests.comm.gather.checks import assert_same_bytes, gather_input

pytestmark = pytest.mark.gpu

D2D = 3  # cudaMemcpyDeviceToDevice


class DeviceNccl:
    """The calls NCCLComm makes on an NcclCommunicator, between threads on one GPU. Each call
    first waits for its stream (this rank's bytes are written: the gather made that stream
    wait for the quantize), swaps pointers, copies on the stream, waits for it, and lets no
    rank go on before all have read (a rank's next call may overwrite what it sent)."""

    def __init__(self, world, rank):
        import cupy

        self.world, self.rank, self.runtime = world, rank, cupy.cuda.runtime
        self.calls = []

    def _copy(self, dst, src, count, stream):
        if dst != src:
            self.runtime.memcpyAsync(dst, src, count, D2D, stream)

    def allGather(self, send, recv, count, dtype, stream):
        self.calls.append("allGather")
        self.runtime.streamSynchronize(stream)
        for r, src in enumerate(self.world.exchange(self.rank, send)):
            self._copy(recv + r * count, src, count, stream)
        self.runtime.streamSynchronize(stream)
        self.world.exchange(self.rank, None)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append("broadcast")
        self.runtime.streamSynchronize(stream)
        src = self.world.exchange(self.rank, send if self.rank == root else None)[root]
        self._copy(recv, src, count, stream)
        self.runtime.streamSynchronize(stream)
        self.world.exchange(self.rank, None)


@pytest.fixture
def device_nccl(monkeypatch):
    pytest.importorskip("cupy")
    fake = types.SimpleNamespace(NCCL_UINT8=0, groupStart=lambda: None, groupEnd=lambda: None)
    monkeypatch.setattr(nccl_module, "_nccl", lambda: fake)


class _Family:
    def __init__(self, name):
        self.name = name
        if name == "torch":
            self.torch = pytest.importorskip("torch")
        import cupy

        self.cupy = cupy

    def make(self, host):
        if self.name == "torch":  # bf16, as activations are
            return self.torch.from_numpy(host).cuda().to(self.torch.bfloat16)
        return self.cupy.asarray(host)

    def concat(self, parts):
        if self.name == "torch":
            return self.torch.cat(parts)
        return self.cupy.concatenate(parts)

    def stream(self):
        if self.name == "torch":
            return self.torch.cuda.Stream()
        return self.cupy.cuda.Stream(non_blocking=True)

    def current(self, stream):
        """A context making ``stream`` the family's current stream."""
        if self.name == "torch":
            return self.torch.cuda.stream(stream)
        return stream

    def sync(self):
        self.cupy.cuda.Device().synchronize()

    def host(self, buf):
        if buf is None:
            return None
        if self.name == "torch":
            return buf.cpu().numpy()
        return self.cupy.asnumpy(buf)


def _same(fam, got, expected, label):
    fam.sync()
    assert_same_bytes(got, expected, fam.host, (label,))


CASES = [(fb.Block1D(), True, False), (fb.Block1D(), True, True), (fb.MXFP8(), True, False),
         (fb.Block2D(), True, True)]


def _splits(recipe, rowwise, columnwise, n):
    if isinstance(recipe, fb.MXFP8):
        return [[32] * n, [64] + [32] * (n - 1), [0] + [32] * (n - 1),
                [7, 25] + [32] * (n - 2)]  # padded locally; M % 128 != 0: a memset fill
    if columnwise or isinstance(recipe, fb.Block2D):  # ranks start at multiples of 128
        return [[128] * n, [256] + [128] * (n - 1), [0] + [128] * (n - 1),
                [128] * (n - 1) + [5]]  # M % 4 != 0: the 1.0 padding
    return [[5] * n, [6, 0] + [3] * (n - 2), [130, 7] + [1] * (n - 2), [0] * (n - 1) + [9],
            [128] * n]


@pytest.mark.parametrize("family", ["cupy", "torch"])
@pytest.mark.parametrize("recipe,rowwise,columnwise", CASES)
@pytest.mark.parametrize("n", [2, 3])
def test_fake_ranks_gather_is_quantize(device_nccl, family, recipe, rowwise, columnwise, n,
                                       rng):
    fam = _Family(family)
    k = 96 if isinstance(recipe, fb.MXFP8) else 300
    for rows in _splits(recipe, rowwise, columnwise, n):
        hosts = [[gather_input(rng, r, k) for r in rows] for _ in range(4)]
        inputs = [[fam.make(h) for h in step] for step in hosts]
        expected = [fb.quantize(fam.concat(step), recipe, rowwise, columnwise)
                    for step in inputs]
        fam.sync()
        label = f"{recipe} rowwise={rowwise} columnwise={columnwise} rows={rows} {family}"

        def body(comm, rows=rows, inputs=inputs, expected=expected, label=label):
            me = comm.rank
            side, other = fam.stream(), fam.stream()
            with fam.current(side):  # a non-default current stream
                out, _ = gather_along_first_dim(inputs[0][me], comm, recipe, rowwise,
                                                columnwise, sizes=rows)
                _same(fam, out, expected[0], label + " first call")
                # out= on new data: checked once, then the steady state
                hits = plan_cache(comm).hits
                again, _ = gather_along_first_dim(inputs[1][me], comm, recipe, rowwise,
                                                  columnwise, sizes=rows, out=out)
                assert again is out and plan_cache(comm).hits == hits + 1
                _same(fam, out, expected[1], label + " out= on the current stream")
                again, _ = gather_along_first_dim(inputs[2][me], comm, recipe, rowwise,
                                                  columnwise, sizes=rows, out=out)
                assert again is out and plan_cache(comm).hits == hits + 2
                _same(fam, out, expected[2], label + " steady state")
            # an explicit communication stream, asynchronous (the fix-up's calls are made
            # again for that stream)
            again, handle = gather_along_first_dim(inputs[3][me], comm, recipe, rowwise,
                                                   columnwise, sizes=rows, out=out,
                                                   stream=other, async_op=True)
            assert handle.wait() is out
            _same(fam, out, expected[3], label + " stream=, async")
            return comm.stats.last_gather_path
        paths, _ = run_ranks(n, body, DeviceNccl)
        assert set(paths) == {"fast"}, (label, paths)


@pytest.mark.parametrize("family", ["cupy", "torch"])
def test_peers_of_a_joined_rank_raise_on_the_device(device_nccl, family, rng):
    """One rank's sizes= malformed after checked calls: it joins with zeros and status 1 and
    raises at once; its peers' call returns (their status copy is behind an event), and they
    raise in check_pending (which waits for it) naming that rank; then nothing is pending and
    the next call is exact everywhere."""
    from fp8blk.comm.gather import check_pending

    fam, n, k, rows = _Family(family), 2, 256, [128, 64]
    hosts = [[gather_input(rng, r, k) for r in rows] for _ in range(3)]
    inputs = [[fam.make(h) for h in step] for step in hosts]
    expected = fb.quantize(fam.concat(inputs[2]), fb.Block1D())
    fam.sync()

    def body(comm):
        me = comm.rank
        out, _ = gather_along_first_dim(inputs[0][me], comm, fb.Block1D(), sizes=rows)
        gather_along_first_dim(inputs[1][me], comm, fb.Block1D(), sizes=rows, out=out)
        if me == n - 1:
            with pytest.raises(ValueError, match="joined the collectives .* with zeros"):
                gather_along_first_dim(inputs[1][me], comm, fb.Block1D(), sizes=rows[:-1],
                                       out=out)
        else:
            gather_along_first_dim(inputs[1][me], comm, fb.Block1D(), sizes=rows, out=out)
            with pytest.raises(ValueError, match=f"rank {n - 1} passed sizes= that are "
                                                 f"malformed"):
                check_pending(comm)
        check_pending(comm)
        again, _ = gather_along_first_dim(inputs[2][me], comm, fb.Block1D(), sizes=rows,
                                          out=out)
        check_pending(comm)
        _same(fam, again, expected, f"{family}: the call after")
        return True
    run_ranks(n, body, DeviceNccl)
