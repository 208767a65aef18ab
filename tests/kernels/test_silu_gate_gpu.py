"""The SiLU-gate kernels (fp8blk/kernels/silu_gate.py) on the GPU, byte for byte against torch's
own kernels: ``F.silu(g) * u`` forward and autograd's backward of it, in bf16 and fp16, on
separate operands and on the two halves of one (M, 2I) buffer (the experts' layout), with
infinities, NaN, signed zeros and exp's overflow range in g; and the torch layer's gate
(fp8blk.torch.mlp) with the kernels against torch's ops (``pytest -m gpu tests/kernels``)."""
import numpy as np
import pytest

from tests.kernels._silu_gate_checks import gate_rows

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from fp8blk.kernels import silu_gate  # noqa: E402
from fp8blk.torch import mlp  # noqa: E402

F = torch.nn.functional


def _inputs(m, i, dtype, seed):
    import ml_dtypes

    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else np.dtype(np.float16)
    arrays = gate_rows(np.random.default_rng(seed), m, i, np_dt)
    return [torch.from_numpy(a.view(np.int16).copy()).view(dtype).cuda() for a in arrays]


def _bits(t):
    return t.contiguous().view(torch.int16)


def _torch_gate(g, u, dp):
    g, u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    p = F.silu(g) * u
    p.backward(dp)
    return p, g.grad, u.grad


# (M, I): the experts' Qwen3-30B-A3B and Mixtral widths, Llama-8B's, one chunk per row, a
# single row, rows not filling a CTA
CASES = [(4096, 768), (700, 14336), (1000, 1024), (333, 8), (1, 24), (1025, 72)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,i", CASES)
@pytest.mark.parametrize("halves", [False, True])
def test_kernels_give_torch_bytes(m, i, dtype, halves):
    g, u, dp = _inputs(m, i, dtype, seed=m + i)
    if halves:                                   # g, u: the halves of one (M, 2I) buffer
        h = torch.cat([g, u], dim=1)
        g, u = h[:, :i], h[:, i:]
    want = _torch_gate(g, u, dp)
    p = silu_gate.forward(g, u)
    if halves:
        dh = torch.full((m, 2 * i), float("nan"), dtype=dtype, device="cuda")
        dg, du = silu_gate.backward(g, u, dp, dh[:, :i], dh[:, i:])
    else:
        dg, du = silu_gate.backward(g, u, dp, torch.empty_like(dp), torch.empty_like(dp))
    for name, got, w in zip(("p", "dg", "du"), (p, dg, du), want):
        assert torch.equal(_bits(got), _bits(w)), name


def test_serves_only_what_it_takes():
    g = torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda")
    assert silu_gate.serves(g, g)
    assert not silu_gate.serves(g[:, :12], g[:, :12])              # I not a multiple of 8
    assert not silu_gate.serves(g.float(), g.float())              # fp32
    assert not silu_gate.serves(g, g.half())                       # dtypes differ
    assert not silu_gate.serves(g[:, 1:9], g[:, :8])               # address not 16-byte
    assert not silu_gate.serves(g.t().contiguous().t(), g)         # rows not contiguous
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        silu_gate.forward(g[:, 1:9], g[:, :8])


def test_layer_gate_with_kernels_equals_torch(monkeypatch):
    """fp8blk.torch.mlp's gate (the dense gated MLP's and the experts') with the kernels on:
    forward, both gradients and the experts' concatenated gradient byte-equal to torch's
    kernels (FP8BLK_GATE_KERNELS=0)."""
    g, u, dp = _inputs(512, 1536, torch.bfloat16, seed=1)
    h = torch.cat([g, u], dim=1).view(2, 256, 3072)
    dp = dp.view(2, 256, 1536)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(mlp, "KERNELS", on)
        hh = h.detach().clone().requires_grad_()
        p = mlp.silu_gate(*hh.chunk(2, dim=-1))
        p.backward(dp)
        cat = mlp.silu_gate_backward_cat(h.view(512, 3072), dp.view(512, 1536))
        outs[on] = (p, hh.grad, cat, mlp.silu_gate_forward(*h.chunk(2, dim=-1)))
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(_bits(a), _bits(b))
