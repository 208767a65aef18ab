"""GPU checks of Float8BlockLinear's per-signature hot path (fp8blk/torch/linear/plans.py):
a step it serves gives the general path's bytes exactly -- output, input gradient, weight
gradient, bias gradient -- on fresh data each step (rows and columns spanning orders of
magnitude, so every block gets its own scale), and signatures it must not serve take the
general path. Exact equality is the right bar: both paths run the same quantize kernels on
the same inputs and the same cuBLAS GEMMs on the same bytes."""
import pytest
import torch

import fp8blk as fb
from fp8blk.kernels import quantize as kquantize
from fp8blk.kernels._launch import LaunchSite
from fp8blk.torch import Float8BlockConfig, Float8BlockLinear
from fp8blk.torch import _arena, _cublaslt
from fp8blk.torch.linear import functional
from fp8blk.torch.linear import hot as linear_hot
from fp8blk.torch.linear import plans as linear_plans

from .._parity import assert_same, init_spread_, spread

pytestmark = pytest.mark.gpu


def _step(layer, x, g):
    layer.weight.grad = None
    if layer.bias is not None:
        layer.bias.grad = None
    x = x.detach().requires_grad_(x.requires_grad)
    y = layer(x)
    y.backward(g)
    return [y, x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad]


def _general(monkeypatch):
    """Steps on the general path: no plan, and no layer memo (which holds one)."""
    monkeypatch.setattr(linear_plans, "plan_for", lambda *a: None)
    monkeypatch.setattr(linear_hot.Hot, "__call__", lambda self, *a: None)


CASES = [
    dict(shape=(512, 1024), n=1536, dtype=torch.bfloat16, bias=True),
    dict(shape=(2, 512, 512), n=1024, dtype=torch.bfloat16, bias=False),
    dict(shape=(1024, 512), n=512, dtype=torch.float32, bias=True),
    dict(shape=(512, 512), n=512, dtype=torch.float16, bias=False),
    dict(shape=(512, 1024), n=512, dtype=torch.bfloat16, bias=True,
         cfg=Float8BlockConfig(grad=fb.Block1D(fb.E5M2))),
    dict(shape=(512, 512), n=1024, dtype=torch.bfloat16, bias=True, x_grad=False),
    dict(shape=(512, 512), n=1024, dtype=torch.bfloat16, bias=True, w_grad=False),
    # shapes torch's blockwise kernel would need padded: K-block counts not a multiple of 4,
    # a partial last token block (cuBLASLt directly, unpadded: test_unaligned_plans_...)
    dict(shape=(1008, 640), n=384, dtype=torch.bfloat16, bias=True),
    dict(shape=(2, 200, 384), n=896, dtype=torch.bfloat16, bias=False),
    dict(shape=(1008, 640), n=384, dtype=torch.float32, bias=False),
    # ... and ones cuBLASLt declines (rows / features not multiples of 16): torch._scaled_mm
    # where it takes the buffers as they are, else padded copies
    dict(shape=(300, 512), n=512, dtype=torch.bfloat16, bias=True),
    dict(shape=(512, 200), n=272, dtype=torch.bfloat16, bias=True),
    dict(shape=(300, 640), n=272, dtype=torch.float16, bias=False),
]


def _case_layer(case, gen):
    shape, n, dtype = case["shape"], case["n"], case["dtype"]
    cfg = case.get("cfg", Float8BlockConfig())
    layer = Float8BlockLinear(shape[-1], n, bias=case["bias"], config=cfg, device="cuda",
                              dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(spread(layer.weight.shape, gen, dtype))
        if layer.bias is not None:
            layer.bias.copy_(spread(layer.bias.shape, gen, dtype))
    layer.weight.requires_grad_(case.get("w_grad", True))
    return layer


@pytest.mark.parametrize("case", CASES)
def test_plan_steps_equal_the_general_path(case, rng, monkeypatch):
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    shape, n, dtype = case["shape"], case["n"], case["dtype"]
    layer = _case_layer(case, gen)
    linear_plans.plans.clear()
    for i in range(3):                  # fresh data each step; the plan made on step 0
        x = spread(shape, gen, dtype).cuda().requires_grad_(case.get("x_grad", True))
        g = spread(shape[:-1] + (n,), gen, dtype).cuda()
        got = _step(layer, x, g)
        assert len(linear_plans.plans) == 1, "the step did not take the plan"
        with monkeypatch.context() as m:
            _general(m)
            want = _step(layer, x, g)
        assert_same(got, want, (case, i))


def _allocating_path(m):
    """The plan's other path: every buffer from torch's allocator (as under capture)."""
    m.setattr(linear_plans._Lean, "stream", lambda self: None)


@pytest.mark.parametrize("case", CASES + [
    dict(shape=(1024, 1024), n=1024, dtype=torch.bfloat16, bias=False, keep=True),
    dict(shape=(1008, 640), n=384, dtype=torch.bfloat16, bias=True, keep=True, x_grad=False)])
def test_lean_steps_equal_the_allocating_plan(case, rng, monkeypatch):
    """The plan's lean path (transients in the stream's arena, raw launches, GEMMs on their
    own descriptors) gives the bytes of its allocating path on every shape class above, over
    steps whose scale pointers move (fresh saved copies) and with the arena regrown in
    between by a larger layer; it serves every signature whose three GEMMs cuBLASLt takes."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    shape, n, dtype = case["shape"], case["n"], case["dtype"]
    layer = _case_layer(case, gen)
    layer.keep_input = case.get("keep", False)
    big = Float8BlockLinear(2048, 3072, bias=False, device="cuda", dtype=torch.bfloat16)
    linear_plans.plans.clear()
    _arena.release()
    for i in range(3):
        x = spread(shape, gen, dtype).cuda().requires_grad_(case.get("x_grad", True))
        g = spread(shape[:-1] + (n,), gen, dtype).cuda()
        got = _step(layer, x, g)
        with monkeypatch.context() as m:
            _allocating_path(m)
            want = _step(layer, x, g)
        assert_same(got, want, (case, i))
        if i == 0:      # a larger layer regrows the arena between the steps
            held = _arena.held()
            _step(big, torch.ones(4096, 2048, device="cuda", dtype=torch.bfloat16),
                  torch.ones(4096, 3072, device="cuda", dtype=torch.bfloat16))
            assert _arena.held() > held
    linear_plans.plans.clear()
    layer._hot = None               # the layer's memo holds the plan: a fresh one is made
    _step(layer, x, g)
    (plan,) = linear_plans.plans.values()
    served = all(isinstance(mm, _cublaslt.ScaledMM) for mm in
                 (plan.mm_fwd, plan.mm_dgrad, plan.mm_wgrad) if mm is not None)
    assert (plan.lean is not None) == served, (case, served)


def _allocations(fn):
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


def test_lean_step_allocates_what_outlives_it(rng, monkeypatch):
    """A warm lean step allocates y, x's saved columnwise copy (data, scales), dx and dW and
    nothing else (its FP8 transients and cuBLASLt workspaces are the arena's); the
    allocating path takes every buffer from torch's allocator."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    layer = Float8BlockLinear(1024, 1536, bias=False, device="cuda", dtype=torch.bfloat16)
    init_spread_(layer, gen)
    x = spread((1024, 1024), gen, torch.bfloat16).cuda().requires_grad_()
    g = spread((1024, 1536), gen, torch.bfloat16).cuda()

    def step():
        x.grad = layer.weight.grad = None
        layer(x).backward(g)
    step()
    lean = _allocations(step)
    with monkeypatch.context() as m:
        _allocating_path(m)
        step()
        allocating = _allocations(step)
    print(f"allocations per step: lean {lean}, allocating path {allocating}")
    assert lean <= 6 and allocating >= lean + 8, (lean, allocating)


def test_lean_path_runs_on_the_default_stream_only(rng):
    """The lean path serves the device's default stream; on another stream (a side stream of
    the caller's, or inductor's CUDA-graph warm-up stream, whose allocations go to the graph's
    pool) the plan allocates: the same bytes, no arena made there."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    layer = Float8BlockLinear(1024, 1536, device="cuda", dtype=torch.bfloat16)
    init_spread_(layer, gen)
    x = spread((1024, 1024), gen, torch.bfloat16).cuda().requires_grad_()
    g = spread((1024, 1536), gen, torch.bfloat16).cuda()
    _arena.release()
    want = _step(layer, x, g)
    one = _arena.held()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _step(layer, x, g)
        side_allocs = _allocations(lambda: _step(layer, x, g))
    torch.cuda.current_stream().wait_stream(side)
    assert_same(got, want, "side stream")
    assert one > 0 and _arena.held() == one and side_allocs >= 14, (one, side_allocs)


def test_plan_path_skips_the_general_quantize(rng, monkeypatch):
    """Once a plan exists, a step never enters the general path's quantize or GEMM check,
    and still gives the general path's bytes."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    layer = Float8BlockLinear(512, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(spread((512, 512), gen, torch.bfloat16))
        layer.bias.copy_(spread((512,), gen, torch.bfloat16))
    x = spread((512, 512), gen, torch.bfloat16).cuda().requires_grad_(True)
    _step(layer, x, torch.ones(512, 512, device="cuda", dtype=torch.bfloat16))
    g = spread((512, 512), gen, torch.bfloat16).cuda()
    with monkeypatch.context() as m:
        _general(m)
        want = _step(layer, x, g)

    def boom(*a, **k):
        raise AssertionError("general path taken")
    monkeypatch.setattr(functional, "quantize_buffers", boom)
    monkeypatch.setattr(functional, "blockwise_scaled_mm", boom)
    assert_same(_step(layer, x, g), want, "plan step")


def test_unaligned_plans_run_unpadded(rng):
    """A bf16 signature whose dims are multiples of 16 but not of 512 (1008 tokens: a partial
    last block; 640 and 384 features: 5 and 3 K-blocks) runs all three GEMMs on cuBLASLt
    directly (no zero-padded copies, which torch._scaled_mm would need)."""
    from fp8blk.torch import _cublaslt
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    if not _cublaslt.enabled:
        pytest.skip("FP8BLK_CUBLASLT=0")
    layer = Float8BlockLinear(640, 384, device="cuda", dtype=torch.bfloat16)
    linear_plans.plans.clear()
    _step(layer, spread((1008, 640), gen).cuda().bfloat16().requires_grad_(),
          spread((1008, 384), gen).cuda().bfloat16())
    (plan,) = linear_plans.plans.values()
    for mm in (plan.mm_fwd, plan.mm_dgrad, plan.mm_wgrad):
        assert isinstance(mm, _cublaslt.ScaledMM), (mm, _cublaslt.refusals)


@pytest.mark.parametrize("what", ["unaligned", "noncontig_dy", "param_sub"])
def test_signatures_the_plan_must_not_serve(what, rng, monkeypatch):
    """An unaligned input and a weight subclass take the general path (no plan made); a
    non-contiguous dY in a planned step is copied first. All give the general path's bytes."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    m, k, n = 512, 512, 512
    layer = Float8BlockLinear(k, n, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(spread((n, k), gen, torch.bfloat16))
    if what == "param_sub":
        class Sub(torch.nn.Parameter):
            pass
        layer.weight = Sub(layer.weight.detach().clone())
    if what == "unaligned":             # 2 bytes past an allocation's start
        x = torch.empty(m * k + 1, device="cuda", dtype=torch.bfloat16)[1:].view(m, k)
        x.copy_(spread((m, k), gen, torch.bfloat16))
    else:
        x = spread((m, k), gen, torch.bfloat16).cuda()
    x.requires_grad_(True)
    g = spread((m, n), gen, torch.bfloat16).cuda()
    if what == "noncontig_dy":
        g = spread((n, m), gen, torch.bfloat16).cuda().t()
    linear_plans.plans.clear()
    got = _step(layer, x, g)
    assert len(linear_plans.plans) == (1 if what == "noncontig_dy" else 0)
    with monkeypatch.context() as mp:
        _general(mp)
        want = _step(layer, x, g)
    assert_same(got, want, what)


def test_only_the_bias_needs_a_gradient(rng):
    """Frozen weight, input without grad, trainable bias: dbias only (both paths)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    for m in (512, 384):
        layer = Float8BlockLinear(512, 512, device="cuda", dtype=torch.bfloat16)
        layer.weight.requires_grad_(False)
        x = spread((m, 512), gen, torch.bfloat16).cuda()
        g = spread((m, 512), gen, torch.bfloat16).cuda()
        layer(x).backward(g)
        assert torch.equal(layer.bias.grad, g.sum(0))


def test_no_grad_plans_the_forward_only(rng):
    """Under torch.no_grad / torch.inference_mode the plan quantizes x rowwise only and plans
    no backward GEMM, and the output is the grad-mode forward's, byte for byte."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    layer = Float8BlockLinear(1024, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    x = spread((512, 1024), gen).cuda().bfloat16().requires_grad_()
    linear_plans.plans.clear()
    want = layer(x).detach()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = layer(x)
        assert torch.equal(got, want), mode
    (train,) = [p for p in linear_plans.plans.values() if p.qdy is not None]
    (eval_,) = [p for p in linear_plans.plans.values() if p.qdy is None]
    assert train.qx.outs[2] is not None and eval_.qx.outs[2] is None
    assert eval_.qwt is None and eval_.mm_dgrad is None and eval_.mm_wgrad is None


@pytest.mark.parametrize("dims", [(512, 1024, 512), (504, 640, 384), (500, 640, 200)],
                         ids=["aligned", "unpadded", "odd"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_layers_run_the_plan_ops(mode, dims, rng):
    """torch.compile(fullgraph=True) of plan-served layers runs each pass as the plan's ops
    (fp8blk::linear_quantize_x + linear_fwd_mm / linear_bwd, fp8blk/torch/linear/compiled.py)
    and gives eager's bytes:
    output, input gradient, weight gradients, and the output under no_grad. No bias and
    nothing between the layers, so inductor has no op of its own to fuse. Tokens per batch
    row, width, hidden: multiples of 512; of 16 (GEMMs on cuBLASLt unpadded); and not
    (padded GEMMs, features whose scale buffers pad to 4)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    t, w, h = dims
    model = torch.nn.Sequential(
        Float8BlockLinear(w, h, bias=False, device="cuda", dtype=torch.bfloat16),
        Float8BlockLinear(h, w, bias=False, device="cuda", dtype=torch.bfloat16))
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    linear_plans.shape_plans.clear()

    def step(m, x, g):
        for p in model.parameters():
            p.grad = None
        xr = x.clone().requires_grad_()
        y = m(xr)
        y.backward(g)
        return [t.clone() for t in (y, xr.grad, model[0].weight.grad, model[1].weight.grad)]
    for r in range(3):
        init_spread_(model, gen)
        x = spread((2, t, w), gen).cuda().bfloat16()
        g = spread((2, t, w), gen).cuda().bfloat16()
        got, want = step(compiled, x, g), step(model, x, g)
        for name, a, b in zip(("y", "dx", "dW0", "dW1"), got, want):
            assert torch.equal(a, b), (mode, r, name, (a.float() - b.float()).abs().max())
        with torch.no_grad():
            assert torch.equal(compiled(x).clone(), want[0]), (mode, r, "no_grad")
    # both layers' signatures, with and without gradients, came through the ops
    assert len(linear_plans.shape_plans) == 4, list(linear_plans.shape_plans.keys())
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize("dims", [(2048, 1024, 1536), (1000, 640, 384), (300, 512, 272),
                                  (100, 512, 512)],
                         ids=["aligned", "unpadded", "padded", "one-half"])
def test_low_memory_forward_plans(dims, rng):
    """low_memory_forward on the plan path: the forward pass in halves of the tokens (the
    first a multiple of 128 rows; one half when there are <= 128), each a rowwise-only
    quantize and a GEMM into its rows of y, then x's columnwise copy alone; the default
    plan's bytes (y, dx, dW, dbias) on fresh data each step. Dims: GEMMs on cuBLASLt (all
    multiples of 16); on cuBLASLt with partial blocks; on torch._scaled_mm with padded copies
    (rows / features not multiples of 16: the halves' GEMM copies into y's rows); one half."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    m, k, n = dims
    lean_cfg = Float8BlockConfig(low_memory_forward=True)
    default = Float8BlockLinear(k, n, device="cuda", dtype=torch.bfloat16)
    lean = Float8BlockLinear(k, n, device="cuda", dtype=torch.bfloat16, config=lean_cfg)
    lean.weight, lean.bias = default.weight, default.bias
    linear_plans.plans.clear()
    for i in range(2):
        init_spread_(default, gen)
        x = spread((m, k), gen, torch.bfloat16).cuda().requires_grad_()
        g = spread((m, n), gen, torch.bfloat16).cuda()
        assert_same(_step(lean, x, g), _step(default, x, g), (dims, i))
    (plan,) = [linear_plans.plans.get(key) for key in list(linear_plans.plans.keys())
               if lean_cfg in key]
    rows = [h[1] for h in plan.halves]
    assert sum(rows) == m and rows[0] % 128 == 0 if len(rows) == 2 else rows == [m], rows
    assert len(rows) == (2 if m > 128 else 1)


def test_low_memory_forward_peak(rng):
    """The forward pass's peak above its start (x and W already held), bf16, no bias, x and
    W needing gradients: by default y + W's FP8 tiles + both FP8 copies of x (the fused
    pass); with low_memory_forward at most the larger of (y + W's tiles + half an FP8 copy
    of x) and (y + one FP8 copy of x), plus scales -- below y + W's tiles + one FP8 copy of
    x, the peak of a design that quantizes x once for the GEMM (torchao's blockwise Linear)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    m, k, n = 4096, 2048, 2048
    y_b, w8, x8 = 2 * m * n, n * k, m * k
    scales = 4 * (m * (k // 128) * 2 + (n // 128) * (k // 128)) + (1 << 20)  # + 1 MiB slack
    peaks = {}
    for lean in (False, True):
        layer = Float8BlockLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16,
                                  config=Float8BlockConfig(low_memory_forward=lean))
        init_spread_(layer, gen)
        x = spread((m, k), gen, torch.bfloat16).cuda().requires_grad_()
        for _ in range(2):                  # the second call: plan made, nothing cached
            _arena.release()                # the default's transients: the arena, made here
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            y = layer(x)
            torch.cuda.synchronize()
            peaks[lean] = torch.cuda.max_memory_allocated() - start
            del y
    assert peaks[False] >= y_b + w8 + 2 * x8, peaks
    assert peaks[True] <= max(y_b + w8 + x8 // 2, y_b + x8) + scales, peaks
    assert peaks[True] < y_b + w8 + x8, peaks
    print(f"forward peak above start, ({m}, {k}, {n}) bf16: default {peaks[False] / 2**20:.1f}"
          f" MiB, low_memory_forward {peaks[True] / 2**20:.1f} MiB; y + W8 + x8 = "
          f"{(y_b + w8 + x8) / 2**20:.1f} MiB")


def test_low_memory_forward_compiled(rng):
    """torch.compile(fullgraph=True) of a low_memory_forward layer runs its plan through the
    ops (the config travels in the op's config string) in halves, with eager's bytes."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    cfg = Float8BlockConfig(low_memory_forward=True)
    layer = Float8BlockLinear(640, 384, bias=False, device="cuda", dtype=torch.bfloat16,
                              config=cfg)
    init_spread_(layer, gen)
    compiled = torch.compile(layer, fullgraph=True)
    linear_plans.shape_plans.clear()
    x = spread((1000, 640), gen, torch.bfloat16).cuda()
    g = spread((1000, 384), gen, torch.bfloat16).cuda()
    got, want = _step(compiled, x.requires_grad_(), g), _step(layer, x, g)
    assert_same(got, want, "compiled")
    (plan,) = linear_plans.shape_plans.values()
    assert [h[1] for h in plan.halves] == [512, 488]


@pytest.mark.parametrize("lean", [False, True], ids=["fused", "low_memory"])
@pytest.mark.parametrize("dims", [(1024, 1024, 1536), (1000, 640, 272)], ids=["aligned", "odd"])
def test_keep_input_plans_and_ops(dims, lean, rng):
    """keep_input on the plan path, eager and compiled (the plan ops, linear_bwd_x): the
    default layer's bytes (y, dx, dW, dbias) on fresh data each step, eager against eager and
    compiled against compiled (inductor sums dbias in an order of its own); eager keeps x's
    storage (no FP8 copy)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    m, k, n = dims
    cfg = Float8BlockConfig(low_memory_forward=lean)
    default = Float8BlockLinear(k, n, device="cuda", dtype=torch.bfloat16, config=cfg)
    keep = Float8BlockLinear(k, n, device="cuda", dtype=torch.bfloat16, config=cfg)
    keep.weight, keep.bias = default.weight, default.bias
    keep.keep_input = True
    compiled = [torch.compile(layer, fullgraph=True) for layer in (default, keep)]
    for i in range(2):
        init_spread_(default, gen)
        x = spread((m, k), gen, torch.bfloat16).cuda().requires_grad_()
        g = spread((m, n), gen, torch.bfloat16).cuda()
        want = _step(default, x, g)
        kept = []

        def pack(t):
            kept.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = _step(keep, x, g)
        assert_same(got, want, (dims, lean, i, "eager"))
        assert not [t for t in kept if t.dtype in (torch.float8_e4m3fn, torch.uint8)], \
            [(t.shape, t.dtype) for t in kept]
        want = [t.clone() for t in _step(compiled[0], x, g)]
        assert_same(_step(compiled[1], x, g), want, (dims, lean, i, "compiled"))
    torch._dynamo.reset()


def _count_quantize_launches(m):
    """A list that gets one entry per quantize launch (a launch site's, or a launcher's own)
    while `m` (a monkeypatch context) is active: the Linear's GEMMs go through cuBLASLt."""
    launches = []
    site_launch, torch_launch = LaunchSite.launch, kquantize.torch_launch

    def counted_site(self, stream):
        launches.append(self.grid)
        return site_launch(self, stream)

    def counted_call(kernel, grid, *a, **k):
        launches.append(grid)
        return torch_launch(kernel, grid, *a, **k)
    m.setattr(LaunchSite, "launch", counted_site)
    m.setattr(kquantize, "torch_launch", counted_call)
    return launches


@pytest.mark.parametrize("keep", [False, True], ids=["saved", "keep_input"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lean_step_groups_its_quantize_launches(keep, compiled, rng, monkeypatch):
    """A lean step quantizes x and W in one launch (eager; the compiled layer's first op
    quantizes x, its second W) and dY, W's columnwise copy and a keep_input layer's x in one
    launch (the compiled backward op runs the plan's backward pass): two launches fewer than
    one per operand, three with keep_input; the bytes are the general path's."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    # cuBLASLt serves every GEMM (dims multiples of 16), so the plans run lean; edge blocks
    layer = Float8BlockLinear(640, 384, device="cuda", dtype=torch.bfloat16)
    init_spread_(layer, gen)
    layer.keep_input = keep
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    x = spread((1008, 640), gen, torch.bfloat16).cuda().requires_grad_()
    g = spread((1008, 384), gen, torch.bfloat16).cuda()
    linear_plans.plans.clear()
    linear_plans.shape_plans.clear()
    _step(run, x, g)                    # plans, kernels and arena made
    made = list(linear_plans.plans.values()) + list(linear_plans.shape_plans.values())
    assert made and all(p.lean is not None for p in made), made
    with monkeypatch.context() as m:
        launches = _count_quantize_launches(m)
        x.grad = layer.weight.grad = layer.bias.grad = None
        y = run(x)
        forward = len(launches)
        y.backward(g)
        backward = len(launches) - forward
    assert (forward, backward) == ((2 if compiled else 1), 1), (forward, backward)
    got = [y, x.grad, layer.weight.grad, layer.bias.grad]
    if not compiled:                # inductor sums dbias in an order of its own
        with monkeypatch.context() as m:
            _general(m)
            assert_same(got, _step(layer, x, g), (keep, compiled))
    torch._dynamo.reset()
