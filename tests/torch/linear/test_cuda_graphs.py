"""Float8BlockLinear under CUDA graphs (GPU): captured with ``torch.cuda.graph`` and compiled
with ``torch.compile(mode="reduce-overhead")``, the ways torch users take a step's host time
away.

A captured step must run, at each replay, on the data then in its static inputs: nothing
worked out at capture (a scale, the weight's FP8 bytes, a workspace address that something
else reuses) may be baked in. Each replay is compared byte for byte with an eager step on the
same data, which runs the same kernels on the same bytes, so equality is the bar. The data is
fresh for every replay -- rows and columns spanning orders of magnitude, so every block gets
its own scale -- and the weights change in place between replays, as an optimizer step changes
them: a replay that kept the capture's scales or weight bytes would differ."""
import pytest
import torch

from fp8blk.torch import Float8BlockLinear, _cublaslt, convert_to_float8_block
from fp8blk.torch.linear import plans as linear_plans

from .._parity import assert_same, init_spread_, spread

pytestmark = pytest.mark.gpu


def _gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2 ** 31)))


def _clear_grads(model, x):
    for p in model.parameters():
        p.grad = None
    x.grad = None


def _grads(model):
    return [p.grad for p in model.parameters()]


def _eager(model, x, g):
    xr = x.detach().clone().requires_grad_()
    _clear_grads(model, xr)
    y = model(xr)
    y.backward(g)
    return [t.clone() for t in [y, xr.grad] + _grads(model)]


@pytest.mark.parametrize("case", ["plan", "general"])
def test_captured_step_replays_as_eager(case, rng, monkeypatch):
    """plan: two 4096-wide layers at 8192 tokens, the per-signature hot path with its GEMMs on
    cuBLASLt (the H200 picks algorithms that need a workspace for them: allocated per call,
    from the graph's pool under capture). general: the general path (plans turned off),
    with features that are not multiples of 128, a bias, a 3-D input of 300 tokens (padded
    copies, the custom ops, torch._scaled_mm)."""
    monkeypatch.setattr(_cublaslt, "enabled", True)
    gen = _gen(rng)
    if case == "plan":
        model = torch.nn.Sequential(
            *[Float8BlockLinear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
              for _ in range(2)])
        x_shape, out = (8192, 4096), 4096
    else:
        monkeypatch.setattr(linear_plans, "plan_for", lambda *a: None)
        model = torch.nn.Sequential(
            Float8BlockLinear(200, 328, bias=True, device="cuda", dtype=torch.bfloat16))
        x_shape, out = (3, 100, 200), 328
    linear_plans.plans.clear()
    sx = torch.zeros(x_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sg = torch.zeros(x_shape[:-1] + (out,), device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        sx.copy_(spread(x_shape, gen))
        sg.copy_(spread(sg.shape, gen))
    init_spread_(model, gen)
    side = torch.cuda.Stream()       # warm-up off the capture stream, as torch's docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _clear_grads(model, sx)
            model(sx).backward(sg)
    torch.cuda.current_stream().wait_stream(side)
    _clear_grads(model, sx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = model(sx)
        sy.backward(sg)
    # detached: holding sy's autograd graph would keep the parameters' AccumulateGrad nodes
    # of the capture stream alive into the eager steps (torch warns of the stream mismatch)
    static = [sy.detach(), sx.grad] + _grads(model)
    del sy
    if case == "plan":
        (plan,) = linear_plans.plans.values()
        assert all(isinstance(mm, _cublaslt.ScaledMM)
                   for mm in (plan.mm_fwd, plan.mm_dgrad, plan.mm_wgrad)), _cublaslt.refusals
    else:
        assert not linear_plans.plans
    for r in range(3):
        x, g = spread(x_shape, gen).cuda(), spread(sg.shape, gen).cuda()
        init_spread_(model, gen)
        with torch.no_grad():
            sx.copy_(x)
            sg.copy_(g)
        graph.replay()
        got = [t.clone() for t in static]
        assert_same(got, _eager(model, x.bfloat16(), g.bfloat16()), f"{case} replay {r}")


def test_reduce_overhead_compile_equals_eager(rng):
    """torch.compile(mode="reduce-overhead"): inductor with CUDA graphs (cudagraph trees) over
    the layer's custom ops, forward and backward; asserted captured, not skipped. No bias, so
    inductor has no pointwise op of its own to fuse: the bytes are eager's."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    gen = _gen(rng)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384, bias=False, dtype=torch.bfloat16),
                                torch.nn.Linear(384, 256, bias=False, dtype=torch.bfloat16))
    model = convert_to_float8_block(model, share_quantize=False).cuda()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for r in range(4):              # cudagraph trees record on the 2nd call, replay after
        init_spread_(model, gen)
        x = spread((2, 128, 256), gen).cuda().bfloat16()
        g = spread((2, 128, 256), gen).cuda().bfloat16()
        xr = x.clone().requires_grad_()
        _clear_grads(model, xr)
        y = compiled(xr)
        y.backward(g)
        got = [t.clone() for t in [y, xr.grad] + _grads(model)]
        assert_same(got, _eager(model, x, g), f"reduce-overhead call {r}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_first_call_during_capture_says_warm_up():
    """A signature first seen inside a capture raises the warm-up advice (a plan's driver
    work must not be recorded); after a warm-up outside, the same capture works."""
    linear_plans.plans.clear()
    layer = Float8BlockLinear(512, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm the layer up before capture"):
        with torch.cuda.graph(graph):
            layer(x).sum().backward()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    graph.replay()
    assert torch.equal(y, layer(x).detach())
