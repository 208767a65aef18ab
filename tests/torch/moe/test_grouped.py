"""The experts' linear layer (fp8blk/torch/moe/grouped.py) on the CPU: each expert's output and
gradients equal the dense float8_block_linear on its padded segment byte for byte (the same
operands and GEMMs), empty experts get zero weight gradients, the per-expert weight buffers
are fb.quantize's, the down projection fused with the combine (grouped_linear_combine) gives
the two-node path's bytes forward and backward, as does permute fused with the first
projection (permute_grouped_linear, keeping the tokens), and bad input raises."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8blk as fb  # noqa: E402
from fp8blk.torch import Float8BlockConfig, float8_block_linear  # noqa: E402
from fp8blk.torch.moe import combine, grouped_linear, permute, route  # noqa: E402
from fp8blk.torch.moe.gemms import expert_weight_both, expert_weight_buffers  # noqa: E402
from fp8blk.torch.moe.grouped import grouped_linear_combine, permute_grouped_linear  # noqa: E402
from fp8blk.layout import cdiv, round_up  # noqa: E402

from .._parity import saved_storages  # noqa: E402

from ._reference import routing_ids  # noqa: E402


def _run(kind, transposed=False, bias=False, n=384, k=256, experts=4, seed=0):
    torch.manual_seed(seed)
    idx = routing_ids(150, 2, experts, kind, seed)
    r = route(idx, experts)
    x = permute(torch.randn(150, k, dtype=torch.bfloat16), r).requires_grad_()
    shape = (experts, k, n) if transposed else (experts, n, k)
    w = torch.randn(shape, dtype=torch.bfloat16).requires_grad_()
    b = torch.randn(experts, n, dtype=torch.bfloat16).requires_grad_() if bias else None
    y = grouped_linear(x, w, r, bias=b, transposed=transposed)
    dy = torch.randn_like(y) * r.valid_rows().unsqueeze(-1)   # padding rows get no gradient
    y.backward(dy)
    return r, x, w, b, y, dy


@pytest.mark.parametrize("kind,transposed,bias,n", [
    ("balanced", False, False, 384), ("skewed", False, True, 384),
    ("skewed", True, True, 384), ("balanced", False, False, 200)])
def test_equals_dense_per_expert(kind, transposed, bias, n):
    r, x, w, b, y, dy = _run(kind, transposed, bias, n)
    assert not y[~r.valid_rows()].any()                 # padding rows stay zero
    empty = 0
    for e, (start, padded, count) in enumerate(r.host()):
        if not padded:
            assert not w.grad[e].any()
            empty += 1
            continue
        seg = slice(start, start + padded)
        xs = x.detach()[seg].clone().requires_grad_()
        we = (w.detach()[e].t() if transposed else w.detach()[e]).clone().requires_grad_()
        ys = float8_block_linear(xs, we)
        if bias:
            routed = slice(0, count)
            ys = torch.cat([ys[routed] + b.detach()[e], ys[count:]])
        ys.backward(dy[seg])
        assert torch.equal(ys, y[seg])
        assert torch.equal(xs.grad, x.grad[seg])
        assert torch.equal(we.grad.t() if transposed else we.grad, w.grad[e])
        if bias:
            assert torch.equal(dy[start:start + count].sum(0), b.grad[e])
    assert empty == (kind == "skewed")


def _same_bytes(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("transposed,bias,n,w_dtype", [
    (False, False, 384, torch.float32), (True, True, 200, torch.bfloat16)])
def test_linear_combine_equals_the_two_nodes(transposed, bias, n, w_dtype):
    """Output, d x, d W, d bias and the router weights' gradient, compared as bytes, with
    router weights in fp32 (the weighted sum promoted, then cast back) and in bf16."""
    tokens, top_k, experts, k = 150, 2, 4, 256
    r = route(routing_ids(tokens, top_k, experts, "skewed"), experts)
    torch.manual_seed(1)
    x0 = permute(torch.randn(tokens, k, dtype=torch.bfloat16), r)
    w0 = torch.randn((experts, k, n) if transposed else (experts, n, k), dtype=torch.bfloat16)
    b0 = torch.randn(experts, n, dtype=torch.bfloat16) if bias else None
    tw0 = torch.rand(tokens, top_k, dtype=w_dtype)
    dout = torch.randn(tokens, n, dtype=torch.bfloat16)
    got = []
    for fused in (False, True):
        x, w, tw = (t.clone().requires_grad_() for t in (x0, w0, tw0))
        b = b0.clone().requires_grad_() if bias else None
        if fused:
            out = grouped_linear_combine(x, w, r, tw, torch.bfloat16, bias=b,
                                         transposed=transposed)
        else:
            out = combine(grouped_linear(x, w, r, bias=b, transposed=transposed), r, tw,
                          torch.bfloat16)
        out.backward(dout)
        got.append([out, x.grad, w.grad, tw.grad] + ([b.grad] if bias else []))
    for i, (a, b) in enumerate(zip(*got)):
        assert _same_bytes(a, b), i


@pytest.mark.parametrize("kind,transposed,bias,dtype", [
    ("balanced", False, False, torch.bfloat16), ("skewed", True, True, torch.bfloat16),
    ("tiny", False, True, torch.float32)])
def test_permute_linear_equals_the_two_nodes(kind, transposed, bias, dtype):
    """permute_grouped_linear gives grouped_linear(permute(...))'s bytes: y, the tokens'
    gradient, dW and d bias (rows and columns spanning orders of magnitude, empty and
    sub-128 experts), and keeps the tokens themselves, not the permuted rows' columnwise FP8 copy:
    exactly that copy's bytes (data and 128x1 scales) fewer, the tokens' storage among what
    it keeps (with permute's index, which the routing holds)."""
    tokens, top_k, experts, k, n = 150, 2, 4, 256, 384
    r = route(routing_ids(tokens, top_k, experts, kind), experts)
    torch.manual_seed(2)
    # rows and columns spanning orders of magnitude (any padding row not zero would move
    # some 128x1 block's scale)
    h0 = (torch.randn(tokens, k) * torch.logspace(-3, 3, k)
          * torch.logspace(-2, 2, tokens).unsqueeze(1)).to(dtype)
    w0 = torch.randn((experts, k, n) if transposed else (experts, n, k), dtype=torch.bfloat16)
    b0 = torch.randn(experts, n, dtype=torch.bfloat16) if bias else None
    dy = torch.randn(r.rows, n, dtype=dtype) * r.valid_rows().unsqueeze(-1)
    got, kept = [], []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        if fused:
            y, seen = saved_storages(lambda: permute_grouped_linear(
                h, w, r, bias=b, transposed=transposed))
            assert h.untyped_storage().data_ptr() in seen
        else:
            y, seen = saved_storages(lambda: grouped_linear(permute(h, r), w, r, bias=b,
                                                            transposed=transposed))
        kept.append(sum(seen.values()))
        y.backward(dy)
        got.append([y, h.grad, w.grad] + ([b.grad] if bias else []))
    for i, (a, b) in enumerate(zip(*got)):
        assert a.any() and _same_bytes(a, b), i
    # the two nodes keep the copy and permute's index (dest), the one node the tokens
    columnwise = r.rows * k + cdiv(r.rows, 128) * round_up(k, 4) * 4
    assert kept[0] - kept[1] == columnwise + r.dest.nbytes - h0.nbytes, kept


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [256, 200])
def test_weight_buffers_are_quantize_of_each_expert(transposed, rows):
    w = torch.randn(3, rows, 320) * torch.logspace(-3, 3, 3).view(3, 1, 1)
    recipe = Float8BlockConfig().weight
    both = expert_weight_both(w, recipe, transposed)     # one pass, the same bytes
    for rows_first in (True, False):
        d, s = expert_weight_buffers(w, recipe, transposed, rows_first)
        d2, s2 = both[0 if rows_first else 1]
        assert torch.equal(d.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s, s2)
        for e in range(3):
            we = w[e].numpy() if rows_first != transposed else w[e].numpy().T
            q = fb.quantize(np.ascontiguousarray(we), recipe)
            np.testing.assert_array_equal(d[e].view(torch.uint8).numpy(), q.rowwise_data)
            np.testing.assert_array_equal(s[e].numpy(), q.rowwise_scale_inv)


@pytest.mark.parametrize("silu", [False, True])
def test_backward_frees_the_input_gradients_operands_first(monkeypatch, silu):
    """In each experts' backward pass W.T and dY's rowwise copy (the input gradient's
    operands) are dead when the weight gradient runs, before its output (a parameter's size)
    is allocated: eager CUDA hands their memory back at once (the caching allocator is
    stream-ordered), so the pass peaks lower by their bytes. Checked through the operands'
    base tensors' weak references, in the first projection and in the last node."""
    import weakref
    from fp8blk.torch.moe import grouped

    def base(t):
        while t._base is not None:
            t = t._base
        return t
    last, checked = [], []
    rows, weights = grouped.grouped_mm_rows, grouped.grouped_mm_weights

    def rows_spy(a, a_scale, b, b_scale, *args):
        last[:] = [weakref.ref(base(t)) for t in (a, a_scale, b, b_scale)]
        return rows(a, a_scale, b, b_scale, *args)

    def weights_spy(*args):
        checked.append([r() is None for r in last])
        return weights(*args)
    monkeypatch.setattr(grouped, "grouped_mm_rows", rows_spy)
    monkeypatch.setattr(grouped, "grouped_mm_weights", weights_spy)
    torch.manual_seed(0)
    r = route(routing_ids(150, 2, 4, "skewed"), 4)
    h = permute(torch.randn(150, 256, dtype=torch.bfloat16), r)
    w1 = torch.randn(4, 512 if silu else 256, 256, dtype=torch.bfloat16).requires_grad_()
    w2 = torch.randn(4, 384, 256, dtype=torch.bfloat16).requires_grad_()
    top = torch.rand(150, 2, dtype=torch.bfloat16).requires_grad_()
    x = grouped_linear(h.requires_grad_(), w1, r)
    out = grouped_linear_combine(x, w2, r, top, torch.bfloat16, silu_gated=silu)
    out.backward(torch.randn_like(out))
    assert checked == [[True] * 4] * 2, checked


def test_bad_input():
    r = route(torch.zeros(4, 1, dtype=torch.int64), 2)
    x = torch.zeros(r.rows, 128)
    with pytest.raises(ValueError, match="weight must be"):
        grouped_linear(x, torch.zeros(3, 128, 128), r)
    with pytest.raises(ValueError, match="padded layout"):
        grouped_linear(torch.zeros(4, 128), torch.zeros(2, 128, 128), r)
    with pytest.raises(ValueError, match="bias must be"):
        grouped_linear(x, torch.zeros(2, 256, 128), r, bias=torch.zeros(256))
    with pytest.raises(ValueError, match="Block2D"):
        grouped_linear(x, torch.zeros(2, 128, 128), r, Float8BlockConfig.mxfp8())
    with pytest.raises(TypeError, match="dtype"):
        grouped_linear(x.to(torch.int32), torch.zeros(2, 128, 128), r)
    tokens = torch.zeros(4, 128)
    with pytest.raises(ValueError, match=r"hidden must be \(4, K\)"):
        permute_grouped_linear(x, torch.zeros(2, 128, 128), r)
    with pytest.raises(ValueError, match="hidden has 128 features"):
        permute_grouped_linear(tokens, torch.zeros(2, 128, 256), r)
    with pytest.raises(TypeError, match="dtype"):
        permute_grouped_linear(tokens.to(torch.int32), torch.zeros(2, 128, 128), r)
    with pytest.raises(ValueError, match="weight must be"):
        permute_grouped_linear(tokens, torch.zeros(3, 128, 128), r)


@pytest.mark.parametrize("kt,experts", [(3, 6), (1, 9), (16, 5)])
def test_packed_row_scales_lay_each_expert_out_alone(kt, experts):
    """The direct GEMM loop's scale layout (CUDA only; its bookkeeping is device-agnostic): in
    the packed buffer expert e's block (kt, n_e), row-major at kt * start_e, is its column
    range of the (kt, rows) scale buffer, empty experts first, between and last included."""
    from fp8blk.torch.moe.gemms import packed_row_scales
    gen = torch.Generator().manual_seed(kt)
    ids = torch.randint(1, experts - 1, (300, 1), generator=gen)   # experts 0 and E-1 empty
    ids[ids == 3] = 2                                              # and expert 3
    r = route(ids, experts)
    scales = torch.randn(kt, r.rows + 4, generator=gen)            # a padded row stride
    host = r.host()
    end = max(s + n for s, n, _ in host)
    packed = packed_row_scales(scales, r.table, end)
    assert packed.shape == (kt * end,)
    empty = 0
    for s, n, _ in host:
        empty += n == 0
        if n:
            assert torch.equal(packed[kt * s:kt * (s + n)], scales[:, s:s + n].reshape(-1))
    assert empty >= 3
