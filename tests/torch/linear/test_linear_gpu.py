"""GPU checks of fp8blk.torch (``python3 -m pytest -m gpu tests/torch``; skipped without CUDA):
blockwise_scaled_mm on fp8blk's buffers (cuBLASLt directly where its dims are multiples of 16,
else torch._scaled_mm, padded where torch needs it) against the float64 product of the
dequantized operands at aligned and unaligned shapes (K % 128 != 0, rows % 4 != 0,
N % 16 != 0, K-block counts not a multiple of 4), the whole layer against the oracle, and
torch.compile fullgraph on the GPU.

GPU tolerance (derived): cuBLAS's blockwise FP8 GEMM accumulates each 128-long K block in the
tensor cores (about 14 mantissa bits retained, DeepSeek-V3 report sec. 3.3.2) and promotes the
block sums to fp32 with the scales applied. Per element |err| <= (128 * 2^-14 + K * 2^-24)
sum|a b| <= 2^-6 sum|a b| for K <= 2^17; plus the output rounding (2^-8 |y| for bf16)."""
import pytest
import torch

import fp8blk as fb
from fp8blk.torch import Float8BlockConfig, blockwise_scaled_mm, convert_to_float8_block
from fp8blk.torch.scaled_mm import dequantize_operand as _dequant

from .._parity import LINEARS_ONLY, FeedForward, Recorder, assert_within, check_against_oracle, spread

pytestmark = pytest.mark.gpu
GPU_REL = 2.0 ** -6
F8 = torch.float8_e4m3fn


def _ops(m, k, n, gen, b_blocks):
    x = spread((m, k), gen)
    qx = fb.quantize(x.cuda(), fb.Block1D(), rowwise=True, columnwise=False)
    if b_blocks == "128x128":
        qb = fb.quantize(spread((n, k), gen).cuda(), fb.Block2D())
    else:
        qb = fb.quantize(spread((n, k), gen).cuda(), fb.Block1D())
    return (qx.rowwise_data.view(F8), qx.rowwise_scale_inv, qb.rowwise_data.view(F8),
            qb.rowwise_scale_inv, "1x128", b_blocks)


@pytest.mark.parametrize("b_blocks", ["128x128", "1x128"])
@pytest.mark.parametrize("mkn", [(256, 512, 256), (4096, 4096, 4096), (100, 384, 72),
                                 (130, 200, 257), (512, 640, 384), (1, 128, 16)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_scaled_mm_matches_emulation(mkn, b_blocks, out_dtype, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    ops = _ops(*mkn, gen, b_blocks)
    got = blockwise_scaled_mm(*ops, out_dtype=out_dtype)
    # the exact value from the same FP8 operands (dequantized by the emulation's code, which
    # the CPU tests check against fp8blk's NumPy reference), in float64 on the GPU
    a, b = _dequant(ops[0], ops[1], ops[4]).double(), _dequant(ops[2], ops[3], ops[5]).double()
    want = a @ b.T
    bound = GPU_REL * (a.abs() @ b.abs().T)
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * want.abs()
    assert_within(got, want, bound, f"cuda {mkn} {b_blocks} {out_dtype}")


@pytest.mark.parametrize("b_blocks", ["128x128", "1x128"])
@pytest.mark.parametrize("mkn", [(1008, 640, 384), (400, 336, 896), (2000, 4016, 256),
                                 (8000, 384, 128)])
def test_unpadded_k_runs_on_cublaslt(mkn, b_blocks, rng, monkeypatch):
    """K-block counts that are not a multiple of 4 and a partial last K-block (where torch's
    kernel would need zero-padded copies of both operands) run on cuBLASLt directly on
    fp8blk's buffers: torch._scaled_mm is never called, and the result is within the GPU
    bound above of the exact product."""
    from fp8blk.torch import _cublaslt

    def boom(*a, **k):
        raise AssertionError("torch._scaled_mm called: the operands were padded")
    monkeypatch.setattr(_cublaslt, "enabled", True)
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    ops = _ops(*mkn, gen, b_blocks)
    monkeypatch.setattr(torch, "_scaled_mm", boom)
    got = blockwise_scaled_mm(*ops, out_dtype=torch.bfloat16)
    a, b = _dequant(ops[0], ops[1], ops[4]).double(), _dequant(ops[2], ops[3], ops[5]).double()
    want = a @ b.T
    bound = GPU_REL * (a.abs() @ b.abs().T) + 2.0 ** -8 * want.abs()
    assert_within(got, want, bound, f"cuBLASLt unpadded {mkn} {b_blocks}")


def test_ffn_on_gpu_against_oracle(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    model = FeedForward(384, 640).cuda()
    convert_to_float8_block(model, **LINEARS_ONLY)
    rec = Recorder(model)
    x = spread((3, 100, 384), gen).cuda().requires_grad_(True)
    y = model(x)
    (y * spread(y.shape, gen).cuda()).sum().backward()
    # reuse the CPU oracle with the GPU bound: scale the fp32 bound by GPU_REL / (K u)
    import tests.torch._parity as parity
    orig = parity.U32
    parity.U32 = GPU_REL / 128             # gamma_K >= GPU_REL for every K >= 128 here
    try:
        rec.data = {k: {n: (v.cpu() if v is not None else None) for n, v in d.items()}
                    for k, d in rec.data.items()}
        model.cpu()
        check_against_oracle(model, rec, Float8BlockConfig())
    finally:
        parity.U32 = orig


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_on_gpu(backend, rng):
    # aot_eager: the whole FFN equals eager bit for bit. inductor: one bf16 layer with bias
    # (inductor fuses pointwise ops around layers and skips intermediate roundings, which can
    # flip a later FP8 rounding: a difference that is not the layer's)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    if backend == "aot_eager":
        model = FeedForward(256, 384).cuda()
        x = spread((2, 128, 256), gen).cuda()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(256, 384, dtype=torch.bfloat16)).cuda()
        x = spread((2, 128, 256), gen, torch.bfloat16).cuda()
    convert_to_float8_block(model, **LINEARS_ONLY)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend=backend)(x)
    assert torch.equal(eager, compiled)


_FRESH_THREAD_SCRIPT = r"""
import threading, torch, fp8blk as fb
from fp8blk.torch import convert_to_float8_block
torch.cuda.set_device(0)
# 1. the backward pass starts with fp8blk's kernels on autograd's worker thread for GPU 0
M, K = {M}, {K}
if {GENERAL}:     # the general path; else the per-signature hot path (fp8blk.torch.linear.plans)
    from fp8blk.torch.linear import plans
    plans.plan_for = lambda *a: None
model = convert_to_float8_block(torch.nn.Sequential(torch.nn.Linear(K, K, bias=False)),
                                share_quantize=False)
model.cuda()
x = torch.randn(M, K, device="cuda", requires_grad=True)
g = torch.randn(M, K, device="cuda")
model(x).backward(g)
got = x.grad.clone(), model[0].weight.grad.clone()
assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0
# the same step with its backward pass on this thread gives the same bytes
x.grad = model[0].weight.grad = None
torch.autograd.set_multithreading_enabled(False)
model(x).backward(g)
torch.autograd.set_multithreading_enabled(True)
assert torch.equal(x.grad, got[0]) and torch.equal(model[0].weight.grad, got[1])
# 2. a quantize on a new thread whose allocations all come from torch's cache
t = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
want = fb.quantize(t, fb.Block1D()).rowwise_data.clone()
errors = []
def work():
    try:
        got = fb.quantize(t, fb.Block1D())
        assert torch.equal(got.rowwise_data, want)
    except BaseException as exc:
        errors.append(exc)
thread = threading.Thread(target=work)
thread.start(); thread.join()
assert not errors, errors
print("OK")
"""


@pytest.mark.parametrize("mk", [(128, 256, True), (512, 512, False)],
                         ids=["general", "plan"])
def test_kernels_on_threads_without_a_current_context(mk, tmp_path):
    """Regression (H200, 2 ranks): the first backward on GPU 0 raised
    CUDA_ERROR_INVALID_CONTEXT: autograd's worker thread had no current CUDA context (torch
    skips cudaSetDevice when the runtime already reports device 0) and the raw driver launch
    needs one. A fresh process, so that no earlier test bound the context on those threads."""
    import subprocess
    import sys

    script = _FRESH_THREAD_SCRIPT.replace("{M}", str(mk[0])).replace("{K}", str(mk[1])) \
        .replace("{GENERAL}", str(mk[2]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
