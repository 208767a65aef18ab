"""The padded token layout (fp8blk/torch/moe/routing.py): segments on 128-row boundaries in
token order, the permutation and its gradient, the combine, each row tile's expert, and the operand bytes: the
columnwise quantize of the padded rows is, per expert, fb.quantize of its rows alone."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8blk as fb  # noqa: E402
from fp8blk.torch.moe.routing import combine, padded_rows, permute, route  # noqa: E402

from ._reference import combine_against_index, routing_ids  # noqa: E402


@pytest.mark.parametrize("kind,tokens,experts,top_k", [
    ("balanced", 300, 8, 2), ("skewed", 300, 8, 3), ("tiny", 5, 16, 4), ("balanced", 1, 1, 1)])
def test_layout(kind, tokens, experts, top_k):
    idx = routing_ids(tokens, top_k, experts, kind)
    r = route(idx, experts)
    assert r.rows == padded_rows(tokens * top_k, experts) and r.rows % 128 == 0
    host = r.host()
    end = 0
    for e, (start, padded, count) in enumerate(host):
        assert start == end and start % 128 == 0 and padded % 128 == 0
        assert count == int((idx == e).sum()) and count <= padded < count + 128 + (count == 0)
        t, j = torch.where(idx == e)                  # token order within the expert
        assert torch.equal(r.dest[t * top_k + j], torch.arange(start, start + count))
        end = start + padded
    assert end <= r.rows
    assert len(set(r.dest.tolist())) == tokens * top_k
    assert int(r.valid_rows().sum()) == tokens * top_k
    # each 128-row tile's expert (what the one-launch grouped GEMMs read), E past the end
    want = [experts] * (r.rows // 128)
    for e, (start, padded, _) in enumerate(host):
        want[start // 128:(start + padded) // 128] = [e] * (padded // 128)
    tiles = r.tile_experts()
    assert tiles.dtype == torch.int32 and tiles.tolist() == want
    # each padded row's pair and token (the permutation's gather), the pair count past the
    # routed rows
    pairs, sources = r.pairs(), r.sources()
    want = torch.full((r.rows,), tokens * top_k, dtype=torch.int64)
    want[r.dest] = torch.arange(tokens * top_k)
    assert torch.equal(pairs, want) and torch.equal(sources, want // top_k)


def test_permute_combine_and_gradient():
    idx = routing_ids(40, 2, 4, "skewed")
    r = route(idx, 4)
    h = torch.randn(40, 128, dtype=torch.float64, requires_grad=True)
    x = permute(h, r)
    assert torch.equal(x[r.dest], h.repeat_interleave(2, 0))
    assert int((x != 0).any(1).sum()) == 80           # every other row zero
    g = torch.randn_like(x)
    x.backward(g)
    assert torch.allclose(h.grad, g[r.dest].view(40, 2, 128).sum(1))
    w = torch.rand(40, 2, dtype=torch.float64)
    out = combine(x.detach(), r, w, torch.float64)
    assert torch.allclose(out, h.detach() * w.sum(1, keepdim=True))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_combine_gradient_is_autograds_index_backward(compiled, w_dtype):
    """combine's gradient for the expert rows is a gather (zeros for padding rows) where
    autograd's index backward zeroes the rows and scatters into them: the same bytes as
    ``weighted_sum(rows[dest], ...)`` under autograd, eager and under inductor, a -0 product
    landing as +0 (router weights 0 against negative gradients, zero gradient rows); the
    output and the router weights' gradient too."""
    got = combine_against_index("cpu", compiled, w_dtype)
    for i, (a, b) in enumerate(zip(*got)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
    assert (got[0][1] == 0).any() and not torch.signbit(got[0][1]).logical_and(
        got[0][1] == 0).any()


def test_columnwise_bytes_per_expert_equal_each_slice_alone():
    """The 128x1 blocks never cross experts: quantizing the padded rows gives each expert's
    rows the bytes fb.quantize gives them alone (empty and sub-128 experts included)."""
    idx = routing_ids(200, 2, 8, "skewed", seed=3)
    r = route(idx, 8)
    rng = np.random.default_rng(0)
    # rows and columns spanning orders of magnitude
    h = torch.from_numpy((rng.standard_normal((200, 384)) * 10.0 ** rng.integers(
        -3, 4, (200, 1)) * 10.0 ** rng.integers(-2, 3, (1, 384))).astype(np.float32))
    x = permute(h, r).numpy()
    q = fb.quantize(x, fb.Block1D(), rowwise=True, columnwise=True)
    checked = 0
    for e, (start, padded, count) in enumerate(r.host()):
        if not count:
            continue
        alone = fb.quantize(np.ascontiguousarray(x[start:start + count]), fb.Block1D(),
                            rowwise=True, columnwise=True)
        blocks = -(-count // 128)
        np.testing.assert_array_equal(q.columnwise_data[:, start:start + count],
                                      alone.columnwise_data)
        np.testing.assert_array_equal(q.columnwise_scale_inv[start // 128:start // 128 + blocks],
                                      alone.columnwise_scale_inv)
        np.testing.assert_array_equal(q.rowwise_data[start:start + count], alone.rowwise_data)
        checked += count < 128
    assert checked  # a sub-128 expert was among them


def test_bad_input():
    with pytest.raises(ValueError, match="tokens, top_k"):
        route(torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="integer"):
        route(torch.zeros(4, 2), 2)
    r = route(torch.zeros(4, 1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"\(4, H\)"):
        permute(torch.zeros(3, 8), r)
    with pytest.raises(ValueError, match="top_k_weights"):
        combine(torch.zeros(r.rows, 8), r, torch.zeros(4, 2), torch.float32)
