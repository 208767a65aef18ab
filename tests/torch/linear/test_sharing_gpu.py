"""GPU checks of quantize-once sharing (fp8blk/torch/linear/sharing.py) on the eager plan path,
compiled (inductor's CSE) and under CUDA graph capture, and of a tiny Hugging Face Llama with
sharing, Float8BlockRMSNorm and Float8BlockGatedMLP (skipped without transformers): the bytes
of the unshared path with the same swaps exactly."""
import pytest
import torch

from fp8blk.torch import convert_to_float8_block
from fp8blk.torch.linear import sharing

pytestmark = pytest.mark.gpu

from bench import bench_model  # noqa: E402


class Siblings(torch.nn.Module):
    def __init__(self, k=512, n=(512, 128, 128)):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(k, w, bias=False) for w in n)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x), self.c(x)], -1)


def _model(share):
    torch.manual_seed(0)
    model = Siblings().cuda().to(torch.bfloat16)
    return convert_to_float8_block(model, share_quantize=share)


def _run(model, x, g):
    x = x.detach().clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.backward(g)
    return [y, x.grad] + [p.grad for p in model.parameters()]


def _data(m=1024, k=512, n=768):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    g = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    return x, g


def test_plan_path_shares_with_the_same_bytes():
    x, g = _data()
    ref = _run(_model(False), x, g)
    with sharing.counting() as stats:
        got = _run(_model(True), x, g)
    assert (stats.misses, stats.hits) == (1, 2)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def _saved(model, x):
    nbytes, y = bench_model.saved_bytes(lambda: model(x.detach().clone().requires_grad_()),
                                        exclude=list(model.parameters()))
    del y
    return nbytes


def _dx_parts(model, x, g):
    """Each sibling's own input gradient, eager (the bytes of its dgrad GEMM)."""
    x = x.detach().clone().requires_grad_()
    return [torch.autograd.grad(layer(x), x, part)[0]
            for layer, part in zip((model.a, model.b, model.c), g.split([512, 128, 128], -1))]


def _assert_summed_like_inductor(dx, parts):
    """x's gradient is the sum of the siblings' dgrads. Eager autograd adds them in bf16 (two
    roundings); inductor fuses the adds, summing in fp32 and rounding once, as it does for
    nn.Linear siblings. Each part has eager's bytes, so both sums lie within half a bf16 ulp
    of the fp32 sum of the parts (exact here but for fp32's own rounding): within one ulp of
    each other. A wrong dgrad part moves dx by far more."""
    exact = sum(p.float() for p in parts)
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 8)
    assert ((dx.float() - exact).abs() <= ulp.clamp_min(2.0 ** -126)).all()
    assert not torch.equal(dx, torch.zeros_like(dx))


def test_compiled_merges_siblings_and_matches_eager():
    """Compiled, the sharing cache is not used (the root's hooks return at once while
    traced); the siblings' fp8blk::linear_quantize_x nodes merge in inductor's CSE instead,
    so the graph keeps one columnwise copy of x, as eager sharing does. y and the weight
    gradients have eager's bytes; x's gradient differs from eager's only in how inductor
    adds the siblings' parts (see _assert_summed_like_inductor)."""
    x, g = _data()
    ref = _run(_model(False), x, g)
    dx_parts = _dx_parts(_model(False), x, g)
    eager_shared = _saved(_model(True), x)
    assert 2.5 * eager_shared < _saved(_model(False), x)  # one copy against three
    for share in (True, False):
        torch._dynamo.reset()
        model = _model(share)
        model.compile()
        with sharing.counting() as stats:
            got = _run(model, x, g)
        assert stats.misses == stats.hits == 0
        assert torch.equal(ref[0], got[0])                       # y
        for a, b in zip(ref[2:], got[2:]):                         # the weight gradients
            assert torch.equal(a, b)
        _assert_summed_like_inductor(got[1], dx_parts)
        assert _saved(model, x) <= eager_shared, share
    torch._dynamo.reset()


def test_cuda_graph_replay_of_a_shared_step():
    x, g = _data()
    model = _model(True)
    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static_x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad = None
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with sharing.counting() as stats, torch.cuda.graph(graph):
        y = model(static_x)
        y.backward(g)
    assert (stats.misses, stats.hits) == (1, 2)
    fresh, _ = _data(k=512)
    fresh = fresh * 3
    static_x.data.copy_(fresh)
    graph.replay()
    ref = _run(_model(False), fresh, g)
    for a, b in zip(ref, [y, static_x.grad] + [p.grad for p in model.parameters()]):
        assert torch.equal(a, b)


def test_tiny_llama_same_bytes_on_cuda():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    runs = []
    for variant in ("fp8blk_norm_mlp", "fp8blk_opt"):    # sharing alone changes no byte
        model = bench_model.build_model("llama", variant, 2, 128, "cuda", tiny=True)
        step, _ = bench_model.make_step(model, ids)
        losses = [step().detach() for _ in range(3)]
        runs.append(losses + [p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
