"""The weighted-rows kernel (fp8blk/kernels/weighted_rows.py) on the GPU, byte for byte against
torch's ops for the experts' combine gradient: ``(g * w).to(dtype)`` of each token's expanded
gradient, put into zeros by autograd's accumulating index put, with +-0, inf and NaN in the
rows, zero and negative weights, padding rows (``pytest -m gpu tests/kernels``)."""
import numpy as np
import pytest

from tests.kernels._weighted_rows_checks import rows_case

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from fp8blk.kernels.weighted_rows import serves, weighted_rows  # noqa: E402


def _torch_rows(src, w, pairs, top_k, rows):
    """Autograd's arithmetic: the product in the promoted dtype, cast, accumulated into zeros
    at each pair's row (``dest``, the inverse of ``pairs``)."""
    n = w.numel()
    dest = torch.empty(n, dtype=torch.int64, device=src.device)
    live = pairs < n
    dest[pairs[live]] = torch.nonzero(live).squeeze(1)
    g = src.to(torch.promote_types(src.dtype, w.dtype))
    g = g.unsqueeze(1).expand(src.shape[0], n // src.shape[0], src.shape[1]).reshape(n, -1)
    picked = (g * w.reshape(-1).unsqueeze(-1)).to(src.dtype)
    out = picked.new_zeros((rows, src.shape[1]))
    out.index_put_((dest,), picked, accumulate=True)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("w_dtype", ["f32", "same"])
@pytest.mark.parametrize("tokens,top_k,width,rows", [(8192, 8, 2048, 81792),
                                                     (4096, 2, 4096, 8448), (5, 3, 8, 128),
                                                     (1, 1, 24, 128)])
def test_kernel_gives_torch_bytes(tokens, top_k, width, rows, dtype, w_dtype):
    import ml_dtypes

    np_dt = np.dtype(ml_dtypes.bfloat16)
    src, w, pairs = rows_case(np.random.default_rng(tokens), tokens, top_k, width, rows, np_dt)
    src = torch.from_numpy(src.view(np.int16).copy()).view(dtype).cuda()
    w = torch.from_numpy(w).cuda()
    if w_dtype == "same":
        w = w.to(dtype)
    pairs = torch.from_numpy(pairs).cuda()
    want = _torch_rows(src, w.view(tokens, top_k), pairs, top_k, rows)
    got = weighted_rows(src, w.float(), pairs, top_k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_serves_only_what_it_takes():
    src = torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda")
    w, pairs = torch.zeros(8, device="cuda"), torch.zeros(128, dtype=torch.int64, device="cuda")
    assert serves(src, w, pairs)
    assert not serves(src.float(), w, pairs)
    assert not serves(src.half(), w, pairs)                         # fp16: torch's ops
    assert not serves(src[:, :12], w, pairs)
    assert not serves(src, w.half(), pairs)
    assert not serves(src, w, pairs.int())
    with pytest.raises(ValueError, match="16-byte aligned"):
        weighted_rows(src[:, 1:9], w, pairs, 2)
