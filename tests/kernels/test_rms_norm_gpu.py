"""The RMSNorm kernels (fp8blk/kernels/rms_norm.py) on the GPU against the bounds of
tests/kernels/_rms_norm_checks.py, and against torch's own ops for HF's formula
(``pytest -m gpu tests/kernels``; skipped without CUDA)."""
import numpy as np
import pytest

from tests.kernels._rms_norm_checks import check_backward, check_forward, make_rows

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from fp8blk.kernels import rms_norm  # noqa: E402
from fp8blk.torch.norm import hf_rms_norm  # noqa: E402

def _np_dtype(dtype):
    import ml_dtypes

    return np.dtype({torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16,
                     torch.float32: np.float32}[dtype])


def _to_np(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_cuda(a, dtype):
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(a.copy()).cuda()


# (M, D): Llama / Qwen widths, Qwen3's per-head 128, chunk edges (2056: 257 chunks; 4104 one
# chunk past 4096 in bf16; 24: 3 chunks), a single row, rows not filling a CTA's groups
CASES = [(8192, 4096, torch.bfloat16), (1000, 5120, torch.bfloat16), (4097, 128, torch.bfloat16),
         (333, 2056, torch.bfloat16), (77, 4104, torch.float16), (1, 24, torch.bfloat16),
         (513, 4096, torch.float32), (300, 8, torch.float16), (64, 16384, torch.bfloat16)]


@pytest.mark.parametrize("m,d,dtype", CASES)
def test_forward_and_backward_within_bounds(rng, m, d, dtype):
    npd = _np_dtype(dtype)
    x, dy = make_rows(rng, m, d, npd), make_rows(rng, m, d, npd, spread=2.0)
    if m > 2:
        x[1, d // 3] = np.inf
        x[2] = 0
    w = (1 + 0.3 * rng.standard_normal(d)).astype(np.float32).astype(npd)
    xt, wt, dyt = _to_cuda(x, dtype), _to_cuda(w, dtype), _to_cuda(dy, dtype)
    assert rms_norm.serves(xt, wt)
    y, r = rms_norm.forward(xt, wt, 1e-5)
    assert y.dtype == dtype and r.dtype == torch.float32 and r.shape == (m,)
    err = check_forward(x, w, 1e-5, _to_np(y), _to_np(r))
    assert err is None, err
    dx, dw_part = rms_norm.backward(xt, wt, dyt, r)
    err = check_backward(x, w, dy, _to_np(r), _to_np(dx), _to_np(dw_part))
    assert err is None, err
    # deterministic: the same bytes again
    y2, r2 = rms_norm.forward(xt, wt, 1e-5)
    dx2, dw2 = rms_norm.backward(xt, wt, dyt, r)
    assert torch.equal(y.float().nan_to_num(7.0),
                       y2.float().nan_to_num(7.0))
    assert torch.equal(r.nan_to_num(7.0), r2.nan_to_num(7.0))
    assert torch.equal(dx.float().nan_to_num(7.0), dx2.float().nan_to_num(7.0))
    assert torch.equal(dw_part.nan_to_num(7.0), dw2.nan_to_num(7.0))


@pytest.mark.parametrize("m,d", [(8192, 4096), (4096 * 8, 128)])
def test_against_torch_ops(m, d):
    """HF's formula in torch ops on the same GPU: r within a few ulp, y equal but where a
    different r rounds n = x * r the other way (rare): one unit of n, so up to two of y =
    w * n (|w| up to 2)."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = (torch.randn(m, d, device="cuda", generator=gen)
         * torch.exp(torch.randn(m, 1, device="cuda", generator=gen) * 3)).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(d, device="cuda", generator=gen)).to(torch.bfloat16)
    y, r = rms_norm.forward(x, w, 1e-6)
    r_t = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    assert ((r - r_t).abs() <= 4 * torch.finfo(torch.float32).eps * r_t).all()
    y_t = hf_rms_norm(x, w, 1e-6)
    diff = (y.view(torch.int16).int() - y_t.view(torch.int16).int()).abs()
    assert diff.max() <= 2 and (diff > 0).double().mean() < 1e-3


def test_empty_and_unserved():
    x = torch.empty(0, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    y, r = rms_norm.forward(x, w, 1e-6)
    assert y.shape == (0, 4096) and r.shape == (0,)
    dx, dw_part = rms_norm.backward(x, w, x, r)
    assert dx.shape == (0, 4096) and (dw_part == 0).all()
    assert not rms_norm.serves(torch.ones(4, 100, device="cuda", dtype=torch.bfloat16),
                               torch.ones(100, device="cuda", dtype=torch.bfloat16))
    assert not rms_norm.serves(x, w.float())
    big = torch.ones(2, 65536, device="cuda", dtype=torch.bfloat16)
    assert not rms_norm.serves(big, big[0])
    with pytest.raises(ValueError, match="dy must be"):
        rms_norm.backward(x, w, x.float(), r)
