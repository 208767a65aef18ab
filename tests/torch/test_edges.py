"""Edges of the torch layer on the CPU (one process): config and argument type checks with
clear errors, double backward (supported by the recomputing norm and gated MLP, a clear error
from the FP8 Linear), the autocast choice (the operands' own dtype is quantized, as
TransformerEngine does) and torch.compile under autocast with biased layers giving eager's
bytes."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8blk as fb  # noqa: E402
from fp8blk.torch import (Float8BlockLinear, blockwise_scaled_mm,  # noqa: E402
                          convert_to_float8_block, float8_block_linear)
from fp8blk.torch.mlp import Float8BlockGatedMLP  # noqa: E402
from fp8blk.torch.norm import Float8BlockRMSNorm, hf_rms_norm  # noqa: E402
from fp8blk.torch.linear.functional import quantize_buffers  # noqa: E402


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 32))


# ---------------------------------------------------------------------------------------------
# config and argument checks

@pytest.mark.parametrize("bad", [fb.Block1D(), fb.Block2D(), {}, "default"])
def test_config_must_be_a_float8blockconfig(bad):
    with pytest.raises(TypeError, match="convert_to_float8_block: config must be"):
        convert_to_float8_block(_model(), bad)
    with pytest.raises(TypeError, match="Float8BlockLinear: config must be"):
        Float8BlockLinear(128, 64, config=bad)
    with pytest.raises(TypeError, match="from_linear: config must be"):
        Float8BlockLinear.from_linear(torch.nn.Linear(128, 64), bad)
    with pytest.raises(TypeError, match="float8_block_linear: config must be"):
        float8_block_linear(torch.randn(4, 128), torch.randn(64, 128), None, bad)


def test_model_and_inputs_type_and_rank_checks():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        convert_to_float8_block("model")
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear"):
        Float8BlockLinear.from_linear(torch.nn.Conv1d(4, 4, 1))
    lin = Float8BlockLinear(128, 64)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        lin(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        float8_block_linear(np.zeros((4, 128), np.float32), lin.weight)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        float8_block_linear(torch.randn(4, 128), torch.randn(128))


def test_blockwise_scaled_mm_says_torch_tensor():
    rd, rs, _, _ = quantize_buffers(torch.randn(200, 384), fb.Block1D(), True, False)
    wd, ws, _, _ = quantize_buffers(torch.randn(256, 384), fb.Block2D(), True, False)
    a = rd.view(torch.float8_e4m3fn)
    b = wd.view(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="a must be a torch.Tensor, got numpy.ndarray"):
        blockwise_scaled_mm(a.view(torch.uint8).numpy(), rs, b, ws)
    with pytest.raises(TypeError, match="b_scale_inv must be a torch.Tensor"):
        blockwise_scaled_mm(a, rs, b, ws.numpy())
    assert blockwise_scaled_mm(a, rs, b, ws).shape == (200, 256)


# ---------------------------------------------------------------------------------------------
# double backward

def test_double_backward_through_the_linear_raises_not_loses():
    torch.manual_seed(0)
    lin = Float8BlockLinear(128, 64)
    x = torch.randn(32, 128, requires_grad=True)
    gx, = torch.autograd.grad(lin(x).square().sum(), x, create_graph=True)
    assert gx.requires_grad          # a graph was asked for: never a gradient without one
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.square().sum().backward()
    # first order is unchanged
    y = lin(x)
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_double_backward_through_the_compiled_linear_raises():
    # compiled through aot_autograd (inductor's front end; aot_eager skips inductor's C++
    # build), the layer's backward is traced once: a second-order graph raises
    torch._dynamo.reset()
    lin = Float8BlockLinear(128, 64)
    x = torch.randn(32, 128, requires_grad=True)
    y = torch.compile(lin, backend="aot_eager")(x)
    gx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (y.sum() + gx.square().sum()).backward()


def _second_order(fn, inputs):
    """d/d(inputs) of |d(sum(fn^2))/d(inputs[0])|^2."""
    for t in inputs:
        t.grad = None
    out = fn()
    g, = torch.autograd.grad(out.square().sum(), inputs[0], create_graph=True)
    g.square().sum().backward()
    return [t.grad.clone() for t in inputs]


def test_double_backward_through_the_norm_equals_plain_autograd():
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.rand(64) + 0.5)
    x = torch.randn(8, 64, requires_grad=True)
    norm = Float8BlockRMSNorm(w, 1e-6, "hf")
    got = _second_order(lambda: norm(x), [x, w])
    want = _second_order(lambda: hf_rms_norm(x, w, 1e-6), [x, w])
    for a, b in zip(got, want):    # the same terms, summed in another order by autograd
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_double_backward_through_the_gated_mlp_equals_plain_autograd():
    torch.manual_seed(2)
    d, f = 32, 48
    gate, up, down = (torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False),
                      torch.nn.Linear(f, d, bias=False))
    mlp = Float8BlockGatedMLP(gate, up, down, torch.nn.SiLU())
    x = torch.randn(8, d, requires_grad=True)
    params = [x, gate.weight, up.weight, down.weight]
    got = _second_order(lambda: mlp(x), params)
    want = _second_order(lambda: down(torch.nn.functional.silu(gate(x)) * up(x)), params)
    for a, b in zip(got, want):    # the same terms, summed in another order by autograd
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# torch.compile under autocast with biased layers

def test_compile_under_autocast_with_bias_gives_eager_bytes():
    # inductor fuses a cast into the add after it and skips the rounding unless told
    # otherwise; the layer's bias add must round the fp32 bias to bf16 as eager does.
    # (A tiny model: inductor's C++ build of the two graphs takes ~20 s on a 2-core machine.)
    torch.manual_seed(3)
    model = convert_to_float8_block(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)), share_quantize=False)
    x = torch.randn(16, 64)

    def step(m):
        xi = x.clone().requires_grad_(True)
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", torch.bfloat16):
            y = m(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        return [y, xi.grad] + [p.grad.clone() for p in model.parameters()]

    eager = step(model)
    compiled = step(torch.compile(model))
    assert eager[0].dtype == compiled[0].dtype == torch.bfloat16
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# autocast: the operands' own dtype is quantized (TransformerEngine's rule, docs/torch.md)

def test_autocast_quantizes_the_operands_own_dtype_and_outputs_the_autocast_dtype():
    torch.manual_seed(4)
    lin = Float8BlockLinear(256, 384)
    x = torch.randn(128, 256)
    with torch.autocast("cpu", torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16

    def mm(xq, wq):
        qx = quantize_buffers(xq, fb.Block1D(), True, False)
        qw = quantize_buffers(wq, fb.Block2D(), True, False)
        out = blockwise_scaled_mm(qx[0].view(torch.float8_e4m3fn), qx[1],
                                  qw[0].view(torch.float8_e4m3fn), qw[1],
                                  out_dtype=torch.bfloat16)
        return out + lin.bias.detach().to(torch.bfloat16)

    w = lin.weight.detach()
    assert torch.equal(y, mm(x, w))                       # fp32 x and W quantized as they are
    assert not torch.equal(y, mm(x.bfloat16(), w.bfloat16()))   # not cast to bf16 first
