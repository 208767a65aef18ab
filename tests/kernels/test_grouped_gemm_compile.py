"""The one-launch grouped GEMM kernels (fp8blk/kernels/_grouped_gemm_kernel.py) compile to PTX for
compute capability 9.0 without a GPU, with the Hopper instructions they are built on: wgmma
m64n128k32 e4m3 (four per 128-deep block), 2-D tensor copies and bulk copies completing on
mbarriers, the register split, the staged epilogue (stmatrix, bulk tensor stores); and, where
ptxas is installed, assemble for sm_90a without spilling (the accumulators stay in registers).
The kernels themselves run in tests/kernels/test_grouped_gemm_gpu.py (WGMMA and TMA have no
simulator)."""
import os
import re
import shutil
import subprocess

import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
pytestmark = pytest.mark.skipif(SIM, reason="compile_ptx needs the real Numba CUDA target")
LOCAL = re.compile(r"\b(ld|st)\.local\b")


@pytest.fixture(scope="module", params=["kernel_fn", "weights_kernel_fn"])
def ptx(request):
    from fp8blk.kernels import _grouped_gemm_kernel as gk
    from fp8blk.kernels._numba import compile_ptx_sm90

    argtypes = gk.ARGTYPES if request.param == "kernel_fn" else gk.W_ARGTYPES
    return compile_ptx_sm90(getattr(gk, request.param), argtypes,
                            launch_bounds=(gk.THREADS, 1))


def test_hopper_instructions(ptx):
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 4
    for op in ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx",
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx",
               "mbarrier.try_wait.parity", "mbarrier.arrive.expect_tx",
               "setmaxnreg.dec.sync.aligned.u32 40", "setmaxnreg.inc.sync.aligned.u32 232",
               "stmatrix.sync.aligned.m8n8.x4", "fence.proxy.tensormap::generic.acquire",
               "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group",
               "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read 0",
               "cp.async.bulk.wait_group 0", "fence.proxy.async.shared::cta"):
        assert op in ptx, op
    assert not LOCAL.search(ptx)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas on PATH")
def test_assembles_for_sm90a_without_spills(ptx, tmp_path):
    # the local ptxas may be older than the PTX version Numba's NVVM writes: the instructions
    # used are all in PTX 8.3
    text = re.sub(r"\.target sm_90\b", ".target sm_90a", ptx)
    text = re.sub(r"\.version \d+\.\d+", ".version 8.3", text)
    src = tmp_path / "k.ptx"
    src.write_text(text)
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr[-2000:]
    assert "C7508" not in r.stderr and "C7514" not in r.stderr, r.stderr[-2000:]
