"""Float8BlockLinear on the CPU (one process): forward, input and weight gradients against an
independent oracle (fp8blk's NumPy reference + float64 matmul, bound derived in _parity),
unaligned features, bias, E5M2/MXFP8 configs, saved-activation memory, torch.compile
fullgraph, planted bugs, the FSDP weight hook, and bad input."""
import copy

import pytest
import torch

import fp8blk as fb
from fp8blk.torch import (Float8BlockConfig, Float8BlockLinear, blockwise_scaled_mm,
                          convert_to_float8_block)
from fp8blk.torch import linear as linear_mod

from .._parity import (LINEARS_ONLY, PLANTS, U32, FeedForward, Recorder, assert_within,
                       check_against_oracle, init_spread_, oracle_linear, set_plant, spread)


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2 ** 31)))


def _run(model, x, gen):
    """forward + backward with a fixed output gradient g spanning magnitudes."""
    y = model(x)
    g = spread(y.shape, gen, y.dtype)
    (y * g).sum().backward()
    return y


CONFIGS = {"default": Float8BlockConfig(),
           "e5m2_grad": Float8BlockConfig(grad=fb.Block1D(fb.E5M2)),
           "no_pow2": Float8BlockConfig(activation=fb.Block1D(pow2_scales=False),
                                        weight=fb.Block2D(pow2_scales=False),
                                        grad=fb.Block1D(pow2_scales=False)),
           "mxfp8": Float8BlockConfig.mxfp8()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ffn_against_oracle(name, gen):
    cfg = CONFIGS[name]
    # features 256/384/320 (not all multiples of 128; multiples of 32 for MXFP8), 2x64 tokens
    model = torch.nn.Sequential(torch.nn.Linear(384, 320), torch.nn.GELU(),
                                torch.nn.Linear(320, 256, bias=False))
    init_spread_(model, gen)
    convert_to_float8_block(model, cfg, **LINEARS_ONLY)
    rec = Recorder(model)
    x = spread((2, 64, 384), gen).requires_grad_(True)
    _run(model, x, gen)
    assert set(rec.data) == {"0", "2"} and all("dx" in v for v in rec.data.values())
    check_against_oracle(model, rec, cfg)


@pytest.mark.parametrize("shape", [(100, 200, 72), (130, 129, 257), (1, 16, 8)])
def test_unaligned_shapes_and_bias(shape, gen):
    m, k, n = shape
    lin = torch.nn.Linear(k, n)
    init_spread_(lin, gen)
    model = torch.nn.Sequential(lin)
    convert_to_float8_block(model, **LINEARS_ONLY)
    rec = Recorder(model)
    _run(model, spread((m, k), gen).requires_grad_(True), gen)
    check_against_oracle(model, rec, Float8BlockConfig())


def test_bf16_model_and_no_input_grad(gen):
    lin = Float8BlockLinear(256, 128, dtype=torch.bfloat16)
    init_spread_(lin, gen)
    x = spread((64, 256), gen, torch.bfloat16)             # no requires_grad: no dgrad GEMM
    y = lin(x)
    assert y.dtype == torch.bfloat16 and lin.weight.grad is None
    g = spread(y.shape, gen, torch.bfloat16)
    (y.float() * g.float()).sum().backward()               # dY = g, exactly
    assert lin.weight.grad.dtype == torch.bfloat16 and lin.bias.grad is not None
    # the same FP8 math as the fp32 oracle (bf16 values quantize to the same bytes as their
    # fp32 copies), then bf16 roundings (u = 2^-8): the GEMM's result, the bias add, the weight
    # gradient, the bias gradient (an fp32 sum rounded to bf16)
    ref = oracle_linear(x.float(), lin.weight.detach().float(), g.float(), Float8BlockConfig())
    value, bound = ref["y"]
    b = lin.bias.detach().double()
    bf16 = 2.0 ** -8
    assert_within(y, value + b, bound + bf16 * (value.abs() + b.abs() + (value + b).abs()),
                  "bf16 forward")
    value, bound = ref["dw"]
    assert_within(lin.weight.grad, value, bound + bf16 * value.abs(), "bf16 weight grad")
    gsum, m = g.double().sum(0), g.shape[0]
    assert_within(lin.bias.grad, gsum, m * U32 / (1 - m * U32) * g.double().abs().sum(0)
                  + bf16 * gsum.abs(), "bf16 bias grad")


def test_only_the_bias_needs_a_gradient(gen):
    """Frozen weight and an input without grad: only dbias = dY summed over tokens (this raised
    "quantize needs rowwise=True or columnwise=True" before: dY was quantized for no GEMM)."""
    from fp8blk.torch.linear import plans as linear_plans
    lin = Float8BlockLinear(256, 128)
    lin.weight.requires_grad_(False)
    x = spread((3, 64, 256), gen)
    g = spread((3, 64, 128), gen)
    lin(x).backward(g)
    assert lin.weight.grad is None
    assert torch.equal(lin.bias.grad, g.reshape(-1, 128).sum(0))
    assert not linear_plans.plans          # the per-signature plans are CUDA-only


def _saved(fn, params):
    """Tensors autograd saves for backward during fn(), minus the parameters (no new memory)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    owned = {p.untyped_storage().data_ptr() for p in params}   # views of a parameter too
    return [t for t in saved if t.untyped_storage().data_ptr() not in owned]


@pytest.mark.parametrize("m", [512, 300])
def test_saved_activation_is_fp8(m, gen):
    k, n = 384, 256
    lin = Float8BlockLinear(k, n, dtype=torch.bfloat16)
    x = spread((m, k), gen, torch.bfloat16).requires_grad_(True)
    # the parameters are excluded: W itself is saved (held anyway), its FP8 form is not
    fp8 = [t for t in _saved(lambda: lin(x), list(lin.parameters())) if t.numel()]
    assert all(t.dtype in (torch.uint8, torch.float32) for t in fp8), [t.dtype for t in fp8]
    # x's columnwise FP8 buffer (K, M) and its scales, nothing else
    shapes = sorted(tuple(t.shape) for t in fp8)
    assert shapes == sorted([(k, m), (-(-m // 128), -(-k // 4) * 4)]), shapes
    fp8_bytes = sum(t.numel() * t.element_size() for t in fp8)
    bf16 = _saved(lambda: torch.nn.functional.linear(x, lin.weight, lin.bias),
                  list(lin.parameters()))
    bf16_bytes = sum(t.numel() * t.element_size() for t in bf16)
    assert bf16_bytes == 2 * m * k                       # nn.Linear saves bf16 x
    # activation: M*K FP8 bytes + scales instead of 2*M*K
    assert fp8_bytes == m * k + 4 * (-(-m // 128)) * (-(-k // 4) * 4)
    print(f"saved for backward, M={m} K={k} N={n}: fp8blk {fp8_bytes} B, bf16 {bf16_bytes} B")


def test_no_grad_forward_skips_the_columnwise_copy(gen, monkeypatch):
    """Without grad mode no backward follows: x is quantized rowwise only (no columnwise copy
    written or kept), and the output is the grad-mode forward's, byte for byte. The grad-mode
    call must ask for the columnwise copy, so the recording cannot pass vacuously."""
    from fp8blk.torch.linear import functional
    asked = []
    real = functional.quantize_input

    def recording(x2d, recipe, need_columnwise):
        asked.append(need_columnwise)
        return real(x2d, recipe, need_columnwise)
    monkeypatch.setattr(functional, "quantize_input", recording)
    lin = Float8BlockLinear(384, 256, dtype=torch.bfloat16)
    x = spread((300, 384), gen, torch.bfloat16).requires_grad_(True)
    want = lin(x).detach()
    assert asked == [True]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = lin(x)
        assert not got.requires_grad and torch.equal(got, want), mode
    assert asked == [True, False, False]


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_is_exact(reentrant, gen):
    """torch.utils.checkpoint around an FFN: the reentrant form runs the first forward under
    no_grad (so without x's columnwise copy) and recomputes it in grad mode for backward; both
    forms give the un-checkpointed outputs and gradients byte for byte."""
    from torch.utils.checkpoint import checkpoint
    model = FeedForward(256, 384)
    init_spread_(model, gen)
    convert_to_float8_block(model, **LINEARS_ONLY)
    x, g = spread((2, 128, 256), gen), spread((2, 128, 256), gen)
    results = []
    for wrapped in (False, True):
        m = copy.deepcopy(model)
        xr = x.clone().requires_grad_()
        y = checkpoint(m, xr, use_reentrant=reentrant) if wrapped else m(xr)
        (y * g).sum().backward()
        results.append([y.detach(), xr.grad] + [p.grad for p in m.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_compile_fullgraph_matches_eager(gen):
    model = FeedForward(256, 384)
    init_spread_(model, gen)
    convert_to_float8_block(model, **LINEARS_ONLY)
    x = spread((2, 64, 256), gen)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ye = model(xe)
    ye.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    yc = compiled(xc)
    yc.sum().backward()
    assert torch.equal(ye, yc) and torch.equal(xe.grad, xc.grad)
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)


def test_compile_inductor_fullgraph(gen):
    # no graph break anywhere in the layer under the default backend either
    torch._dynamo.reset()
    model = convert_to_float8_block(torch.nn.Sequential(torch.nn.Linear(256, 128)),
                                    **LINEARS_ONLY)
    x = spread((64, 256), gen)
    ye = model(x)
    yc = torch.compile(model, fullgraph=True)(x)
    assert torch.equal(ye, yc)


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_bug_fails_the_oracle(plant, gen):
    # square layer and tokens = features so every planted bug passes the shape checks and
    # can only be caught by the numbers
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    init_spread_(model, gen)
    convert_to_float8_block(model, **LINEARS_ONLY)
    rec = Recorder(model)
    undo = set_plant(plant)
    try:
        _run(model, spread((256, 256), gen).requires_grad_(True), gen)
        with pytest.raises(AssertionError, match="exceed the bound"):
            check_against_oracle(model, rec, Float8BlockConfig())
    finally:
        undo()


class _HookWeight(torch.nn.Parameter):
    """Stand-in for the FSDP2 weight: hands out a prequantized BlockTensor."""

    calls = []

    def fp8blk_block_tensor(self, rowwise, columnwise):
        type(self).calls.append((rowwise, columnwise))
        return fb.quantize(self.detach(), fb.Block2D(), rowwise, columnwise)


def test_weight_hook_is_used_and_gets_the_gradient(gen):
    lin = Float8BlockLinear(256, 128, bias=False)
    plain = copy.deepcopy(lin)
    lin.weight = _HookWeight(lin.weight.detach().clone())
    x = spread((64, 256), gen)
    y1, y2 = lin(x), plain(x)
    assert _HookWeight.calls == [(True, False)]
    assert torch.equal(y1, y2)
    y1.sum().backward()
    y2.sum().backward()
    assert torch.equal(lin.weight.grad, plain.weight.grad)


# -- bad input ---------------------------------------------------------------------------------

def _operands(gen, m=64, k=256, n=128):
    x, w = spread((m, k), gen), spread((n, k), gen)
    qx, qw = fb.quantize(x, fb.Block1D()), fb.quantize(w, fb.Block2D())
    f8 = torch.float8_e4m3fn
    return [qx.rowwise_data.view(f8), qx.rowwise_scale_inv, qw.rowwise_data.view(f8),
            qw.rowwise_scale_inv], x, w


def test_scaled_mm_matches_oracle_and_rejects_bad_layouts(gen):
    (a, sa, b, sb), x, w = _operands(gen)
    out = blockwise_scaled_mm(a, sa, b, sb, "1x128", "128x128", torch.float32)
    value, bound = oracle_linear(x, w, None, Float8BlockConfig())["y"]
    assert out.shape == (64, 128)
    assert_within(out, value, bound, "blockwise_scaled_mm")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        blockwise_scaled_mm(a.view(torch.uint8), sa, b, sb, "1x128", "128x128")
    with pytest.raises(ValueError, match="row-major"):
        blockwise_scaled_mm(a.t(), sa, b, sb, "1x128", "128x128")
    with pytest.raises(ValueError, match=r"a_scale_inv .*Block1D rowwise scale layout"):
        blockwise_scaled_mm(a, sa.t().contiguous(), b, sb, "1x128", "128x128")
    with pytest.raises(ValueError, match=r"b_scale_inv for 1x128 .*Block1D rowwise scale layout: contiguous torch.float32\(2, 128\)"):
        blockwise_scaled_mm(a, sa, b, sb, "1x128", "1x128")
    with pytest.raises(ValueError, match="share K"):
        blockwise_scaled_mm(a, sa, b[:, :128].contiguous(), sb, "1x128", "128x128")
    with pytest.raises(TypeError, match="out_dtype"):
        blockwise_scaled_mm(a, sa, b, sb, "1x128", "128x128", torch.int32)
    with pytest.raises(ValueError, match="a_blocks"):
        blockwise_scaled_mm(a, sa, b, sb, "1x64", "128x128")


def quantize_requests(monkeypatch):
    """A list that records (shape, rowwise, columnwise) of each quantize the layers ask for."""
    from fp8blk.torch.linear import functional
    asked = []
    real = functional.quantize_buffers

    def recording(x2d, recipe, rowwise, columnwise):
        asked.append((tuple(x2d.shape), rowwise, columnwise))
        return real(x2d, recipe, rowwise, columnwise)
    monkeypatch.setattr(functional, "quantize_buffers", recording)
    return asked


@pytest.mark.parametrize("name", ["default", "mxfp8"])
@pytest.mark.parametrize("grads", ["both", "x_only", "w_only"])
def test_low_memory_forward_gives_the_default_bytes(name, grads, gen, monkeypatch):
    """low_memory_forward quantizes x rowwise, runs the GEMM, and only then quantizes x
    columnwise (config.py): the same bytes -- output, input and weight gradients -- as the
    default's fused pass, and each quantize asks for one direction only (so the order is the
    one claimed, not the fused pass again)."""
    base = CONFIGS[name]
    lean = Float8BlockConfig(base.activation, base.weight, base.grad, low_memory_forward=True)
    asked = quantize_requests(monkeypatch)
    m, k, n = 320, 384, 256
    x = spread((m, k), gen, torch.bfloat16)
    w = spread((n, k), gen, torch.bfloat16)
    g = spread((m, n), gen, torch.bfloat16)
    out = []
    for cfg in (base, lean):
        xr = x.clone().requires_grad_(grads != "w_only")
        wr = w.clone().requires_grad_(grads != "x_only")
        asked.clear()
        y = linear_mod.float8_block_linear(xr, wr, None, cfg)
        forward_quantizes = [a for a in asked if a[0] == (m, k)]
        y.backward(g)
        out.append((y, xr.grad, wr.grad, forward_quantizes))
    (y0, dx0, dw0, q0), (y1, dx1, dw1, q1) = out
    assert torch.equal(y0, y1)
    for a, b in ((dx0, dx1), (dw0, dw1)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    w_grad = grads != "x_only"
    assert q0 == [((m, k), True, w_grad)]
    assert q1 == [((m, k), True, False)] + ([((m, k), False, True)] if w_grad else [])


def test_low_memory_forward_config():
    from fp8blk.torch.linear.compiled import _config, config_key
    for cfg in (Float8BlockConfig(low_memory_forward=True), Float8BlockConfig(),
                Float8BlockConfig.mxfp8(low_memory_forward=True)):
        assert _config(config_key(cfg)) == cfg
    assert config_key(Float8BlockConfig()) != config_key(
        Float8BlockConfig(low_memory_forward=True))
    with pytest.raises(TypeError, match="low_memory_forward must be a bool"):
        Float8BlockConfig(low_memory_forward=1)


def test_bad_features_dtypes_and_configs():
    with pytest.raises(ValueError, match="multiples of 32"):
        Float8BlockLinear(100, 64, config=Float8BlockConfig.mxfp8())
    with pytest.raises(ValueError, match="MXFP8 must be used"):
        Float8BlockConfig(weight=fb.MXFP8())
    with pytest.raises(TypeError, match="weight must be fp8blk.Block2D"):
        Float8BlockConfig(weight=fb.Block1D())
    lin = Float8BlockLinear(128, 64)
    with pytest.raises(TypeError, match="input dtype"):
        lin(torch.randn(4, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(4, 64))
    with pytest.raises(TypeError, match="weight dtype"):
        linear_mod.float8_block_linear(torch.randn(4, 128), torch.randn(64, 128).double())
    with pytest.raises(ValueError, match="CUDA or CPU tensors, got a meta tensor"):
        lin.to("meta")(torch.randn(4, 128, device="meta"))


def test_autocast_output_dtype_and_grads(gen):
    # fp32 parameters under bf16 autocast: bf16 output (as F.linear), fp32 dx and dW
    lin = Float8BlockLinear(256, 128)
    x = spread((64, 256), gen).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    # the same FP8 math: the GEMM's fp32 result rounded to bf16, the bias rounded to bf16, their
    # sum rounded to bf16: within 2^-8 (|mm| + |bias| + |y|) of the fp32 layer's output
    with torch.no_grad():
        ref = Float8BlockLinear.from_linear(lin)(x.detach()).double()
        b = lin.bias.double()
    bound = 2.0 ** -8 * ((ref - b).abs() + b.abs() + ref.abs())
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("name", ["default", "mxfp8"])
@pytest.mark.parametrize("lean", [False, True], ids=["fused", "low_memory"])
@pytest.mark.parametrize("grads", ["both", "x_only", "w_only"])
def test_keep_input_gives_the_default_bytes(name, lean, grads, gen, monkeypatch):
    """keep_input=True keeps x itself, not its columnwise FP8 copy, and makes that copy in the
    backward pass: the default's bytes (y, dx, dW, dbias); the forward pass quantizes x
    rowwise only and the backward pass columnwise only (only where a weight gradient
    follows); what is saved is x's storage and W."""
    base = CONFIGS[name]
    cfg = Float8BlockConfig(base.activation, base.weight, base.grad, low_memory_forward=lean)
    asked = quantize_requests(monkeypatch)
    m, k, n = 320, 384, 256
    x = spread((2, m // 2, k), gen, torch.bfloat16)
    w = spread((n, k), gen, torch.bfloat16)
    b = spread((n,), gen, torch.bfloat16)
    g = spread((2, m // 2, n), gen, torch.bfloat16)
    out = []
    for keep in (False, True):
        xr = x.clone().requires_grad_(grads != "w_only")
        wr = w.clone().requires_grad_(grads != "x_only")
        br = b.clone().requires_grad_()
        asked.clear()
        saved = _saved(lambda: out.append(linear_mod.float8_block_linear(
            xr, wr, br, cfg, keep_input=keep)), [wr, br])
        fwd = [a for a in asked if a[0] == (m, k)]
        asked.clear()
        out[-1].backward(g)
        bwd = [a for a in asked if a[0] == (m, k)]
        out[-1] = (out[-1], xr.grad, wr.grad, br.grad, fwd, bwd, saved, xr)
    (y0, dx0, dw0, db0, *_), (y1, dx1, dw1, db1, fwd, bwd, saved, xr) = out
    assert torch.equal(y0, y1) and torch.equal(db0, db1)
    for u, v in ((dx0, dx1), (dw0, dw1)):
        assert (u is None) == (v is None) and (u is None or torch.equal(u, v))
    w_grad = grads != "x_only"
    assert fwd == [((m, k), True, False)]
    assert bwd == ([((m, k), False, True)] if w_grad else [])
    kept = [t for t in saved if t.numel()]
    if w_grad:   # x (a view of it) and nothing else
        assert [t.untyped_storage().data_ptr() for t in kept] == [
            xr.untyped_storage().data_ptr()], [(t.shape, t.dtype) for t in kept]
    else:
        assert kept == []


def test_keep_input_checks():
    lin = Float8BlockLinear(256, 128)
    assert lin.keep_input is False and "keep_input" not in repr(lin)
    lin.keep_input = True
    assert "keep_input=True" in repr(lin)
    with pytest.raises(TypeError, match="keep_input must be a bool"):
        lin.keep_input = 1
    # x changed in place after the forward pass: autograd's version check, not stale bytes
    x = torch.randn(64, 256, requires_grad=True)
    h = x * 1
    y = lin(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


