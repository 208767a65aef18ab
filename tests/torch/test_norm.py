"""Float8BlockRMSNorm (fp8blk/torch/norm.py) on the CPU: the same output and gradient bytes as
the norm it replaces, only its input saved between the passes, and which modules are
swapped."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import Float8BlockLinear  # noqa: E402
from fp8blk.torch.norm import Float8BlockRMSNorm, convert_norms, hf_rms_norm  # noqa: E402


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


def _saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_bytes_as_the_replaced_norm(dtype):
    width = 160
    gen = torch.Generator().manual_seed(1)
    for ref in _norms(width, dtype):
        new = Float8BlockRMSNorm.from_norm(ref)
        assert new is not None and new.weight is ref.weight, type(ref)
        x = (torch.randn(3, 7, width, generator=gen) * 3).to(dtype)
        dy = torch.randn(3, 7, width, generator=gen).to(dtype)
        grads = []
        for mod in (ref, new):
            xr = x.clone().requires_grad_()
            mod.weight.grad = None
            mod(xr).backward(dy)
            grads.append((mod(xr.detach()), xr.grad, mod.weight.grad.clone()))
        for a, b in zip(*grads):
            assert a.dtype == b.dtype and torch.equal(a, b), type(ref)


def test_saves_only_its_input():
    width = 256
    ref = HFStyleRMSNorm(width).to(torch.bfloat16)
    new = Float8BlockRMSNorm.from_norm(ref)
    x = torch.randn(64, width, dtype=torch.bfloat16, requires_grad=True)
    _, seen_ref = _saved_bytes(lambda: ref(x))
    _, seen_new = _saved_bytes(lambda: new(x))
    w = ref.weight.untyped_storage().data_ptr()
    ref_bytes = sum(v for k, v in seen_ref.items() if k != w)
    new_bytes = sum(v for k, v in seen_new.items() if k != w)
    assert new_bytes == x.numel() * 2                    # x in bf16, nothing else
    assert ref_bytes >= 3 * new_bytes                    # fp32 copy + normalized bf16 + rstd


def test_consumer_quantizes_the_same_bytes():
    """quantize(norm(x)) is unchanged: a Float8BlockLinear after the swapped norm gives the
    same output and gradients."""
    width = 256
    gen = torch.Generator().manual_seed(2)
    ref_norm = HFStyleRMSNorm(width).to(torch.bfloat16)
    lin = Float8BlockLinear(width, 128, bias=False, dtype=torch.bfloat16)
    x = torch.randn(130, width, generator=gen).to(torch.bfloat16)
    outs = []
    for norm in (ref_norm, Float8BlockRMSNorm.from_norm(ref_norm)):
        xr = x.clone().requires_grad_()
        lin.weight.grad = norm.weight.grad = None
        y = lin(norm(xr))
        y.float().square().sum().backward()
        outs.append((y, xr.grad, lin.weight.grad.clone(), norm.weight.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


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


def test_no_grad_and_frozen():
    ref = HFStyleRMSNorm(64)
    new = Float8BlockRMSNorm.from_norm(ref)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(new(x), ref(x))
    ref.weight.requires_grad_(False)
    xr = x.clone().requires_grad_()
    new(xr).sum().backward()
    xr2 = x.clone().requires_grad_()
    ref(xr2).sum().backward()
    assert torch.equal(xr.grad, xr2.grad) and ref.weight.grad is None
