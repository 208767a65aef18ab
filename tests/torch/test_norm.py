"""Float8BlockRMSNorm (fp8blk/torch/norm.py) on the CPU: the same output and gradient bytes as
the norm it replaces, only its input saved between the passes, and which modules are
swapped."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import Float8BlockLinear  # noqa: E402
from fp8blk.torch.norm import Float8BlockRMSNorm, convert_norms, hf_rms_norm  # noqa: E402
from ._parity import saved_storages  # noqa: E402


class HFStyleRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, as its forward reads (cited in fp8blk/torch/norm.py)."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, x):
        return hf_rms_norm(x, self.weight, self.variance_epsilon)


class GemmaStyleRMSNorm(HFStyleRMSNorm):
    def forward(self, x):
        return hf_rms_norm(x, 1.0 + self.weight, self.variance_epsilon)


def _norms(width, dtype):
    out = [HFStyleRMSNorm(width), torch.nn.RMSNorm(width, eps=1e-5), torch.nn.RMSNorm(width)]
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        out.append(LlamaRMSNorm(width, eps=1e-5))
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(width)
    for n in out:
        with torch.no_grad():
            n.weight.copy_(torch.randn(width, generator=gen) * 0.5 + 1)
        n.to(dtype)
    return out


def _run(mod, x, dy):
    """(y with grad, dx, dw)."""
    xr = x.clone().requires_grad_()
    mod.weight.grad = None
    y = mod(xr)
    y.backward(dy)
    return y.detach(), xr.grad, mod.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_bytes_as_the_replaced_norm(dtype):
    """exact_grad=True: output and both gradients byte-equal to autograd's; by default the
    output and dw are, and dx is the written-out backward (tested below)."""
    width = 160
    gen = torch.Generator().manual_seed(1)
    for ref in _norms(width, dtype):
        new = Float8BlockRMSNorm.from_norm(ref, exact_grad=True)
        assert new is not None and new.weight is ref.weight, type(ref)
        x = (torch.randn(3, 7, width, generator=gen) * 3).to(dtype)
        dy = torch.randn(3, 7, width, generator=gen).to(dtype)
        grads = [_run(mod, x, dy) for mod in (ref, new)]
        with torch.no_grad():
            assert torch.equal(new(x), grads[0][0])
        for a, b in zip(*grads):
            assert a.dtype == b.dtype and torch.equal(a, b), type(ref)
        fast = Float8BlockRMSNorm.from_norm(ref)
        y, dx, dw = _run(fast, x, dy)
        assert torch.equal(y, grads[0][0]) and dx.dtype == x.dtype
        if fast.formula == "hf":
            assert torch.equal(dw, grads[0][2]), type(ref)
        else:                                    # the "torch" formula recomputes
            assert torch.equal(dx, grads[0][1]) and torch.equal(dw, grads[0][2])


_UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def _dx_terms(x, w, dy, eps):
    """(the exact dx, S = r * (|g| + |xhat| * mean|g * xhat|)) in float64."""
    h = x.double()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    xhat, g = h * r, dy.double() * w.double()
    exact = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return exact, r * (g.abs() + xhat.abs() * (g * xhat).abs().mean(-1, keepdim=True))


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 4096), (torch.bfloat16, 160),
                                         (torch.float16, 512), (torch.float32, 1024)])
def test_written_out_backward_within_its_bound(dtype, width):
    """dx of the written-out backward pass within (u_x + D u32) S of the exact gradient, and
    within (u_g + 2 u_x + 2 (D + 8) u32) S of autograd's (fp8blk/torch/norm.py)."""
    gen = torch.Generator().manual_seed(width)
    ref = HFStyleRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(width, generator=gen) * 0.5 + 1)
    ref.to(dtype)
    fast = Float8BlockRMSNorm.from_norm(ref)
    x = (torch.randn(2, 33, width, generator=gen) * 3).to(dtype)
    x[0, 0] = x[0, 0].abs() + 1                  # a row where dx cancels (dy = x below)
    dy = torch.randn(2, 33, width, generator=gen).to(dtype)
    dy[0, 0] = (x[0, 0].float() / ref.weight.float()).to(dtype)
    exact, s = _dx_terms(x, ref.weight, dy, 1e-5)
    _, dx_old, dw_old = _run(ref, x, dy)
    y, dx, dw = _run(fast, x, dy)
    u32, ux = 2.0 ** -24, _UNIT[dtype]
    assert torch.equal(dw, dw_old)
    assert ((dx.double() - exact).abs() <= (ux + width * u32) * s).all()
    bound = (_UNIT[torch.promote_types(dy.dtype, ref.weight.dtype)] + 2 * ux
             + 2 * (width + 8) * u32) * s
    diff = (dx.double() - dx_old.double()).abs()
    assert (diff <= bound).all(), (diff / s).max()
    if dtype != torch.float32:                   # the bound is not vacuous: ulps, mostly 0
        assert (diff > 0).any() and (diff == 0).double().mean() > 0.5


def test_backward_is_fewer_ops():
    """The written-out backward pass dispatches fewer aten ops than recomputing the formula
    and asking autograd (top-level ops, views and detaches not counted)."""
    from torch.profiler import ProfilerActivity, profile

    meta = {"aten::view", "aten::detach", "aten::expand", "aten::empty", "aten::as_strided",
            "aten::empty_strided", "aten::empty_like", "aten::lift_fresh"}
    ref = HFStyleRMSNorm(256).to(torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    counts = []
    for exact in (True, False):
        new = Float8BlockRMSNorm.from_norm(ref, exact_grad=exact)
        xr = x.clone().requires_grad_()
        y = new(xr)
        ref.weight.grad = None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y.backward(torch.ones_like(y))
        counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::")
                          and e.name not in meta and (e.cpu_parent is None
                                                      or not e.cpu_parent.name.startswith(
                                                          "aten::"))))
    assert counts[1] <= counts[0] // 2 + 1, counts


@pytest.mark.parametrize("exact_grad", [False, True])
def test_saves_only_its_input(exact_grad):
    width = 256
    ref = HFStyleRMSNorm(width).to(torch.bfloat16)
    new = Float8BlockRMSNorm.from_norm(ref, exact_grad=exact_grad)
    x = torch.randn(64, width, dtype=torch.bfloat16, requires_grad=True)
    _, seen_ref = saved_storages(lambda: ref(x))
    _, seen_new = saved_storages(lambda: new(x))
    w = ref.weight.untyped_storage().data_ptr()
    ref_bytes = sum(v for k, v in seen_ref.items() if k != w)
    new_bytes = sum(v for k, v in seen_new.items() if k != w)
    # x in bf16, and (written-out backward) the fp32 reciprocal RMS per row
    assert new_bytes == x.numel() * 2 + (0 if exact_grad else 64 * 4)
    assert ref_bytes >= 3 * x.numel() * 2                # fp32 copy + normalized bf16 + rstd


@pytest.mark.parametrize("exact_grad", [True, False])
def test_consumer_quantizes_the_same_bytes(exact_grad):
    """quantize(norm(x)) is unchanged: a Float8BlockLinear after the swapped norm gives the
    same output and layer gradients, and the norm's dw (dx too with exact_grad)."""
    width = 256
    gen = torch.Generator().manual_seed(2)
    ref_norm = HFStyleRMSNorm(width).to(torch.bfloat16)
    lin = Float8BlockLinear(width, 128, bias=False, dtype=torch.bfloat16)
    x = torch.randn(130, width, generator=gen).to(torch.bfloat16)
    outs = []
    for norm in (ref_norm, Float8BlockRMSNorm.from_norm(ref_norm, exact_grad=exact_grad)):
        xr = x.clone().requires_grad_()
        lin.weight.grad = norm.weight.grad = None
        y = lin(norm(xr))
        y.float().square().sum().backward()
        outs.append((y, lin.weight.grad.clone(), norm.weight.grad.clone(), xr.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b) or (not exact_grad and a is outs[0][3])


def test_which_modules_are_swapped():
    model = torch.nn.Sequential(HFStyleRMSNorm(64), GemmaStyleRMSNorm(64),
                                torch.nn.RMSNorm(64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 64))
    keys = set(model.state_dict())
    assert convert_norms(model) == 2
    assert [type(m).__name__ for m in model] == [
        "Float8BlockRMSNorm", "GemmaStyleRMSNorm", "Float8BlockRMSNorm", "LayerNorm", "Linear"]
    assert set(model.state_dict()) == keys
    assert convert_norms(model) == 0                     # idempotent


@pytest.mark.parametrize("exact_grad", [True, False])
def test_no_grad_and_frozen(exact_grad):
    ref = HFStyleRMSNorm(64)
    new = Float8BlockRMSNorm.from_norm(ref, exact_grad=exact_grad)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(new(x), ref(x))
    ref.weight.requires_grad_(False)
    xr = x.clone().requires_grad_()
    new(xr).sum().backward()
    xr2 = x.clone().requires_grad_()
    ref(xr2).sum().backward()
    assert ref.weight.grad is None
    if exact_grad:
        assert torch.equal(xr.grad, xr2.grad)
    else:                                        # fp32 throughout: a few fp32 ulps
        torch.testing.assert_close(xr.grad, xr2.grad, rtol=0, atol=64 * 2.0 ** -24)



@pytest.mark.timeout(300)
def test_compiled_qwen3_per_head_norms():
    """Qwen3 normalizes q and k per head ((batch, seq, heads, head_dim) views of the
    projections' outputs, transposed after the norm), so the norm's dY arrives transposed.
    Compiled, the written-out backward must still give dx in x's contiguous layout: the traced
    view backward before the norm cannot take dY's strides (the graph fails to build)."""
    pytest.importorskip("transformers")
    from bench import bench_model
    torch.manual_seed(0)
    model = bench_model.build_model("qwen3", "fp8blk_opt", 1, 64, "cpu", tiny=True)
    assert sum(isinstance(m, Float8BlockRMSNorm) for m in model.modules()) >= 3  # q, k, ...
    bench_model.compile_model(model)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# -- on the GPU: the one-pass kernels (fp8blk/kernels/rms_norm.py) --------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("shape,per_head", [((2, 1024, 4096), False), ((2, 512, 16, 128), True)])
def test_cuda_norm_runs_the_kernels_within_bounds(shape, per_head):
    """Eager CUDA: the output within two bf16 ulp of HF's (one of n = x * r, times w) and
    equal in all but a few elements, dx within (u_x + (D + 8) u32) S of the exact gradient,
    dw within (M u32 + 3 u_bf16) sum|p| of the exact sum (n and p rounded to bf16); a transposed dY (Qwen3's per-head norms) as a contiguous one;
    ``KERNELS = False`` gives HF's bytes (torch's ops)."""
    from fp8blk.torch import norm

    width = shape[-1]
    gen = torch.Generator(device="cuda").manual_seed(width)
    ref = HFStyleRMSNorm(width, eps=1e-6).cuda()
    with torch.no_grad():
        ref.weight.copy_(torch.randn(width, device="cuda", generator=gen) * 0.3 + 1)
    ref.to(torch.bfloat16)
    fast = Float8BlockRMSNorm.from_norm(ref)
    x = (torch.randn(*shape, device="cuda", generator=gen)
         * torch.exp(torch.randn(*shape[:-1], 1, device="cuda", generator=gen) * 2)
         ).to(torch.bfloat16)
    dy = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
    if per_head:                         # dY arrives as the transpose of a contiguous tensor
        dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
    y_ref, _, _ = _run(ref, x, dy)
    y, dx, dw = _run(fast, x, dy)
    ulps = (y.view(torch.int16).int() - y_ref.view(torch.int16).int()).abs()
    assert ulps.max() <= 2 and (ulps > 0).double().mean() < 1e-3
    exact, s = _dx_terms(x.float(), ref.weight.float(), dy.float(), 1e-6)
    assert ((dx.double() - exact).abs() <= (2.0 ** -8 + (width + 8) * 2.0 ** -24) * s).all()
    r = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    p = (dy.double() * (x.double() * r)).reshape(-1, width)
    m = p.shape[0]
    # n and p are rounded to bf16 in the kernels: two more units of bf16 per term
    bound = (m * 2.0 ** -24 + 3 * 2.0 ** -8) * p.abs().sum(0)
    assert ((dw.double() - p.sum(0)).abs() <= bound).all()
    norm.KERNELS = False
    try:
        y_ops, _, _ = _run(fast, x, dy)
    finally:
        norm.KERNELS = True
    assert torch.equal(y_ops, y_ref)
