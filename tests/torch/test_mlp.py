"""Float8BlockGatedMLP (fp8blk/torch/mlp.py) on the CPU: the bytes of the MLP it replaces,
fewer saved bytes, and which modules are swapped."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import convert_to_float8_block  # noqa: E402
from fp8blk.torch.mlp import Float8BlockGatedMLP, convert_gated_mlps  # noqa: E402

from ._parity import LINEARS_ONLY  # noqa: E402


class GatedMLP(torch.nn.Module):
    """transformers' LlamaMLP, as its forward reads (cited in fp8blk/torch/mlp.py)."""

    def __init__(self, d=256, f=384, act=None):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, f, bias=False)
        self.up_proj = torch.nn.Linear(d, f, bias=False)
        self.down_proj = torch.nn.Linear(f, d, bias=False)
        self.act_fn = act if act is not None else torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GeluTimesTwo(GatedMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)


def _step(model, x):
    x = x.clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    y.float().square().sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return [y, x.grad] + [p.grad.clone() for p in model.parameters()], \
        sum(v for k, v in saved.items() if k not in params)


def _acts():
    out = [torch.nn.SiLU(), torch.nn.GELU(approximate="tanh")]
    try:
        from transformers.activations import ACT2FN
        out.append(ACT2FN["silu"])
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("act", _acts(), ids=lambda a: type(a).__name__)
def test_same_bytes_fewer_saved(fp8, act):
    torch.manual_seed(0)
    ref = GatedMLP(act=act).to(torch.bfloat16)
    if fp8:
        holder = torch.nn.Sequential(ref)
        convert_to_float8_block(holder, **LINEARS_ONLY)
    keys = set(ref.state_dict())
    new = Float8BlockGatedMLP.from_mlp(ref)
    assert new is not None and set(new.state_dict()) == keys
    assert new.silu == ("SiLU" in type(act).__name__)
    x = torch.randn(2, 65, 256).to(torch.bfloat16)
    a, saved_ref = _step(ref, x)
    b, saved_new = _step(new, x)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and torch.equal(u, v)
    f = 2 * 65 * 384 * 2                         # one (M, F) bf16 tensor
    assert saved_ref - saved_new == f


def test_which_modules_are_swapped():
    model = torch.nn.Sequential(GatedMLP(), GeluTimesTwo(), torch.nn.Linear(256, 256))
    assert convert_gated_mlps(model) == 1
    assert [type(m).__name__ for m in model] == ["Float8BlockGatedMLP", "GeluTimesTwo",
                                                 "Linear"]
    assert convert_gated_mlps(model) == 0


@pytest.mark.parametrize("act", _acts(), ids=lambda a: type(a).__name__)
@pytest.mark.parametrize("wrap", ["plain", "checkpoint"])
def test_down_projection_keeping_its_input(act, wrap):
    """keep_inputs: the down projection keeps the product as its formula of g and u, so the
    MLP keeps the down projection's FP8 copy (M*F bytes + scales) fewer, with every output and
    gradient byte-equal -- also inside a non-reentrant activation checkpoint (whose hooks
    then see the formula's inputs)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = GatedMLP(act=act).to(torch.bfloat16)
    holder = torch.nn.Sequential(ref)
    convert_to_float8_block(holder, **dict(LINEARS_ONLY, gated_mlps=True))
    run = holder if wrap == "plain" else (lambda x: checkpoint(holder, x, use_reentrant=False))

    class Runner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.holder = holder

        def forward(self, x):
            return run(x)
    x = torch.randn(2, 65, 256).to(torch.bfloat16)
    a, saved_a = _step(Runner(), x)
    convert_to_float8_block(holder, **dict(LINEARS_ONLY, gated_mlps=True, keep_inputs=True))
    assert holder[0].down_proj.keep_input
    b, saved_b = _step(Runner(), x)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and torch.equal(u, v)
    fp8_copy = 2 * 65 * 384 + 2 * 384 * 4                  # (F, M) bytes, (cdiv(M,128), F) fp32
    assert saved_a - saved_b == (fp8_copy if wrap == "plain" else 0), (saved_a, saved_b)
