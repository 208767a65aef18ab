"""The one-launch grouped GEMMs (fp8blk/kernels/grouped_gemm.py) on the H200 against the
per-expert cuBLASLt loops they replace (``fp8blk.torch.moe.gemms`` with the kernels switched
off), at balanced, skewed (empty and > 128-row experts), tiny and 128-expert routings, on
operands whose rows and columns span orders of magnitude:

- m-grouped (forward, and input gradient through the transposed weights read in place): the
  loop's bytes (the same promotion per 128-deep block in the same order), padding tiles zero;
- k-grouped (weight gradient): within one bf16 rounding step of the loop's outputs plus fp32
  noise where a sum cancels (both sum fp32 partial products per 128-token block, in
  different orders), empty experts zero;
- a whole experts layer forward and backward without one host synchronization, and captured
  in a CUDA graph whose replay on new inputs equals eager;
- the default policy: the loop below 17 experts, the kernels from there on.
(``pytest -m gpu tests/kernels``; skipped without CUDA.)"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from fp8blk.kernels import grouped_gemm  # noqa: E402
from fp8blk.torch import Float8BlockConfig  # noqa: E402
from fp8blk.torch.linear.functional import quantize_buffers  # noqa: E402
from fp8blk.torch.moe import grouped_linear, permute, route  # noqa: E402
from fp8blk.torch.moe.gemms import (expert_weight_buffers, grouped_mm_rows,  # noqa: E402
                                    grouped_mm_weights)
from tests.torch.moe._reference import captured, routing_ids  # noqa: E402

CFG = Float8BlockConfig()
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the grouped kernels are sm_90a (Hopper)")


def _rows(tokens, k, seed):
    """(tokens, k) bf16 on the GPU, rows and columns scaled over orders of magnitude."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)) * 10.0 ** rng.integers(-3, 4, (tokens, 1))
    x = x * 10.0 ** rng.integers(-2, 3, (1, k))
    return torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)


@pytest.fixture(autouse=True)
def _kernels_always():
    prev = grouped_gemm.set_policy("always")
    yield
    grouped_gemm.set_policy(prev)


def _loop(fn, *args):
    prev = grouped_gemm.set_policy("never")
    try:
        return fn(*args)
    finally:
        grouped_gemm.set_policy(prev)


def _kernel(fn, *args, serves):
    assert serves, "the one-launch kernel does not serve this case"
    return fn(*args)


CASES = [("balanced", 1000, 8, 2, 512, 768), ("skewed", 1000, 8, 2, 512, 768),
         ("tiny", 9, 16, 4, 256, 384), ("skewed", 700, 6, 3, 640, 256),
         ("balanced", 2048, 128, 8, 768, 1536)]


@pytest.mark.parametrize("kind,tokens,experts,top_k,k,n", CASES)
def test_rows_equal_the_loop(kind, tokens, experts, top_k, k, n):
    r = route(routing_ids(tokens, top_k, experts, kind, seed=3, device="cuda"), experts)
    x = permute(_rows(tokens, k, 1), r)
    w = (torch.randn(experts, n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    qx = quantize_buffers(x, CFG.activation, True, False)
    wd, ws = expert_weight_buffers(w, CFG.weight, False, True)
    args = (qx[0].view(E4M3), qx[1], wd, ws, r, torch.bfloat16)
    want = _loop(grouped_mm_rows, *args)
    got = _kernel(grouped_mm_rows, *args, serves=grouped_gemm.serves(*args[:4], torch.bfloat16))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    # the input gradient: dY (rows, n) against W_e.T read in place (experts along columns)
    dy = _rows(r.rows, n, 2) * r.valid_rows().unsqueeze(-1)
    qdy = quantize_buffers(dy, CFG.grad, True, False)
    wtd, wts = expert_weight_buffers(w, CFG.weight, False, False)
    assert wtd.stride(1) == experts * n             # the in-place view, not a copy
    args = (qdy[0].view(E4M3), qdy[1], wtd, wts, r, torch.bfloat16)
    want = _loop(grouped_mm_rows, *args)
    got = _kernel(grouped_mm_rows, *args, serves=grouped_gemm.serves(*args[:4], torch.bfloat16))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_rows_past_the_segments_are_zero_and_every_row_is_written():
    r = route(routing_ids(300, 2, 8, "skewed", seed=4, device="cuda"), 8)
    x = permute(_rows(300, 256, 5), r)
    w = torch.randn(8, 256, 256, device="cuda").to(torch.bfloat16)
    qx = quantize_buffers(x, CFG.activation, True, False)
    wd, ws = expert_weight_buffers(w, CFG.weight, False, True)
    junk = torch.full((r.rows, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    del junk
    y = grouped_mm_rows(qx[0].view(E4M3), qx[1], wd, ws, r, torch.bfloat16)
    end = int((r.starts + r.padded).max())
    assert end < r.rows and not y[end:].any()
    assert not torch.isnan(y).any()


@pytest.mark.parametrize("kind,tokens,experts,top_k,k,n", CASES)
def test_weights_within_bound_of_the_loop(kind, tokens, experts, top_k, k, n):
    r = route(routing_ids(tokens, top_k, experts, kind, seed=6, device="cuda"), experts)
    x = permute(_rows(tokens, k, 7), r)
    dy = _rows(r.rows, n, 8) * r.valid_rows().unsqueeze(-1)
    qx = quantize_buffers(x, CFG.activation, False, True)
    qdy = quantize_buffers(dy, CFG.grad, False, True)
    args = (qdy[2].view(E4M3), qdy[3], qx[2].view(E4M3), qx[3], r, torch.bfloat16)
    want = _loop(grouped_mm_weights, *args)
    got = _kernel(grouped_mm_weights, *args,
                  serves=grouped_gemm.serves_weights(*args[:4], torch.bfloat16, experts))
    g, f = got.float(), want.float()
    for e, (_, padded, _) in enumerate(r.host()):
        if not padded:
            assert not got[e].any()
            continue
        # one bf16 rounding step of the larger, or fp32 noise where the expert's sum cancels
        tol = torch.maximum(g[e].abs(), f[e].abs()) * 2.0 ** -7 + f[e].abs().max() * 2.0 ** -14
        assert ((g[e] - f[e]).abs() <= tol).all(), e


def _layer_step(x, w1, w2, r, dy):
    h = grouped_linear(x, w1, r)
    y = grouped_linear(torch.nn.functional.silu(h), w2, r)
    y.backward(dy)
    return y


def test_auto_policy():
    """auto: the loop below AUTO_MIN_EXPERTS experts, the kernel from there on, and under
    CUDA-graph capture at any count."""
    a = torch.empty((128, 128), device="cuda", dtype=E4M3)
    sa = torch.empty((1, 128), device="cuda")
    grouped_gemm.set_policy("auto")
    for experts in (grouped_gemm.AUTO_MIN_EXPERTS - 1, grouped_gemm.AUTO_MIN_EXPERTS):
        b = torch.empty((experts, 128, 128), device="cuda", dtype=E4M3)
        sb = torch.empty((experts, 1, 4), device="cuda")
        want = experts >= grouped_gemm.AUTO_MIN_EXPERTS
        assert grouped_gemm.serves(a, sa, b, sb, torch.bfloat16) == want
        assert grouped_gemm.serves_weights(a, sa, a, sa, torch.bfloat16, experts) == want
    with pytest.raises(ValueError, match="policy"):
        grouped_gemm.set_policy("sometimes")


def test_layer_without_host_synchronization_and_in_a_cuda_graph():
    experts, top_k, tokens, k, n = 8, 2, 512, 256, 384
    ids = routing_ids(tokens, top_k, experts, "skewed", seed=9, device="cuda")
    hidden = _rows(tokens, k, 10)
    w1 = (torch.randn(experts, n, k, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(experts, k, n, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()

    def step(ids, hidden, dy):
        r = route(ids, experts)
        x = permute(hidden, r)
        return _layer_step(x, w1, w2, r, dy[:r.rows] * r.valid_rows().unsqueeze(-1))

    rows = route(ids, experts).rows
    dy = _rows(rows, k, 11)
    hidden.requires_grad_()
    step(ids, hidden, dy)                         # compile and warm up, tensor maps made
    torch.cuda.synchronize()
    w1.grad = w2.grad = hidden.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(ids, hidden, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = (w1.grad.clone(), w2.grad.clone(), hidden.grad.clone())

    # a CUDA graph of the same step, replayed on new routing and inputs of the same shapes
    def fresh_step():
        w1.grad = w2.grad = hidden.grad = None
        return step(ids, hidden, dy)
    graph, y_static = captured(fresh_step)
    ids2 = routing_ids(tokens, top_k, experts, "balanced", seed=12, device="cuda")
    hidden2, dy2 = _rows(tokens, k, 13), _rows(rows, k, 14)
    ids.copy_(ids2)
    hidden.data.copy_(hidden2)
    dy.copy_(dy2)
    graph.replay()
    got = (w1.grad.clone(), w2.grad.clone(), hidden.grad.clone(), y_static.clone())
    w1.grad = w2.grad = hidden.grad = None
    y = step(ids, hidden, dy)
    for a, b in zip(got, (w1.grad, w2.grad, hidden.grad, y)):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], want[0])        # the replay saw the new inputs
