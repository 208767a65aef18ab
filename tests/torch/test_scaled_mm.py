"""blockwise_scaled_mm's CUDA plumbing checked on the CPU: ``cuda_scaled_mm`` runs with
``torch._scaled_mm`` replaced by a stand-in that enforces torch's documented blockwise layout
rules (aten/src/ATen/native/cuda/Blas.cpp: is_blockwise_1x128_scaling /
is_blockwise_128x128_scaling, mat1 row-major, mat2 column-major, K % 128 == 0 for blockwise,
mat2 dims % 16 == 0) and computes what those scales mean. The result must equal the CPU
emulation (within the fp32 dot-product bound): this checks every view, transpose, scale
stride and padding copy of the CUDA path at unaligned shapes without a GPU."""
import pytest
import torch

import fp8blk as fb
from fp8blk.layout import cdiv, round_up
from fp8blk.torch import scaled_mm as sm

from ._parity import U32, assert_within, spread

F8 = torch.float8_e4m3fn


def _size_stride_ok(t, dim, size, stride):
    return t.size(dim) == size and (size <= 1 or t.stride(dim) == stride)


def fake_scaled_mm(a, mat2, scale_a, scale_b, out_dtype):
    m, k = a.shape
    n = mat2.shape[1]
    assert a.is_contiguous(), "mat1 must be row-major"
    assert mat2.t().is_contiguous(), "mat2 must be column-major"
    assert k % 128 == 0, "Invalid scaling configuration (blockwise K % 128)"
    assert mat2.shape[0] % 16 == 0 and n % 16 == 0, "mat2 dims must be multiples of 16"
    kb = k // 128
    if not (_size_stride_ok(scale_a, 0, m, 1) and _size_stride_ok(scale_a, 1, kb, m)):
        raise RuntimeError(f"Invalid scaling configuration: scale_a {scale_a.shape} "
                           f"{scale_a.stride()}")
    sbt = scale_b.t()
    if _size_stride_ok(sbt, 0, n, 1) and _size_stride_ok(sbt, 1, kb, n):
        sb = sbt                                                   # (N, kb)
    elif (sbt.shape == (cdiv(n, 128), kb) and _size_stride_ok(sbt, 1, kb, 1)
          and (sbt.size(0) <= 1 or sbt.stride(0) in (kb, round_up(kb, 4)))):
        sb = sbt.repeat_interleave(128, 0)[:n]                     # 128x128 tiles
    else:
        raise RuntimeError(f"Invalid scaling configuration: scale_b {scale_b.shape} "
                           f"{scale_b.stride()}")
    av = a.float().reshape(m, kb, 128).double()
    bv = mat2.t().float().reshape(n, kb, 128).double()
    part = torch.einsum("mbk,nbk->mnb", av, bv)
    return (part * scale_a.double()[:, None, :] * sb.double()[None, :, :]).sum(-1).to(out_dtype)


@pytest.mark.parametrize("b_blocks", ["128x128", "1x128"])
@pytest.mark.parametrize("mkn", [(256, 512, 256), (100, 384, 72), (130, 200, 257),
                                 (1, 128, 16), (64, 640, 384)])
def test_cuda_path_against_torch_layout_rules(mkn, b_blocks, rng, monkeypatch):
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    m, k, n = mkn
    qa = fb.quantize(spread((m, k), gen), fb.Block1D())
    qb = fb.quantize(spread((n, k), gen), fb.Block2D() if b_blocks == "128x128"
                     else fb.Block1D())
    ops = (qa.rowwise_data.view(F8), qa.rowwise_scale_inv, qb.rowwise_data.view(F8),
           qb.rowwise_scale_inv, "1x128", b_blocks)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    got = sm.cuda_scaled_mm(*ops, torch.float32)
    # the operands' values from fp8blk's NumPy reference, not from scaled_mm's own dequantize_operand
    a = qa.dequantize(torch.float32).double()
    b = qb.dequantize(torch.float32).double()
    bound = (k * U32 / (1 - k * U32) + U32) * (a.abs() @ b.abs().T)
    assert got.shape == (m, n) and got.is_contiguous()
    assert_within(got, a @ b.T, bound, f"cuda plumbing {mkn} {b_blocks}")
    assert_within(sm.emulate(*ops, torch.float32), a @ b.T, bound, f"emulation {mkn}")
