"""fp8blk.torch.recompute.saved_as_formula on the CPU: what autograd keeps inside the block,
the gradients, the version check, hooks outside it, and targets it leaves alone."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from fp8blk.torch.recompute import saved_as_formula  # noqa: E402


def _kept(fn):
    kept = []

    def pack(t):
        kept.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


def _inputs():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(6, 32, generator=gen, requires_grad=True)
    u = torch.randn(6, 32, generator=gen, requires_grad=True)
    return g, u


def _formula(g, u):
    return F.silu(g) * u


def test_the_target_and_its_views_are_kept_as_the_formula():
    g, u = _inputs()
    p = _formula(g, u)
    w = torch.randn(32, 8, requires_grad=True)
    calls = []

    def counted(g, u):
        calls.append(1)
        return _formula(g, u)
    def run():
        with saved_as_formula(p, counted, (g, u)):
            # mm keeps p's (6, 16) column-half view and w; pow keeps p itself
            return (p[:, 16:] @ w[16:]).sum() + p.pow(2).sum()
    y, kept = _kept(run)
    assert not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                   for t in kept)
    y.backward()
    assert len(calls) == 2                     # unpacked once per saved use
    g2, u2 = _inputs()
    w2 = w.detach().clone().requires_grad_()
    p2 = _formula(g2, u2)
    ((p2[:, 16:] @ w2[16:]).sum() + p2.pow(2).sum()).backward()
    for a, b in ((g.grad, g2.grad), (u.grad, u2.grad), (w.grad, w2.grad)):
        assert torch.equal(a, b)


def test_an_input_changed_in_place_raises():
    g, u = _inputs()
    gd, ud = g.detach().clone(), u.detach().clone().requires_grad_()
    p = _formula(gd, ud)
    with saved_as_formula(p, _formula, (gd, ud)):
        y = (p * p).sum()
    gd.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_outer_hooks_see_the_inputs_in_place_of_the_target():
    g, u = _inputs()
    p = _formula(g, u)
    outer = []

    def pack(t):
        outer.append(t)
        return ("packed", t)

    def unpack(obj):
        return obj[1]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with saved_as_formula(p, _formula, (g, u)):
            y = (p.exp() * p).sum()        # exp keeps its output (outer), mul p and exp(p)
    ptrs = [t.untyped_storage().data_ptr() for t in outer]
    assert p.untyped_storage().data_ptr() not in ptrs
    assert g.untyped_storage().data_ptr() in ptrs and u.untyped_storage().data_ptr() in ptrs
    y.backward()
    g2, u2 = _inputs()
    p2 = _formula(g2, u2)
    (p2.exp() * p2).sum().backward()
    assert torch.equal(g.grad, g2.grad) and torch.equal(u.grad, u2.grad)


def test_targets_left_alone():
    """A view (its storage is shared with what the formula does not make) and a
    non-contiguous tensor are saved as autograd saves them."""
    g, u = _inputs()
    base = _formula(g, u)
    for target in (base[1:], base.t()):
        def run():
            with saved_as_formula(target, lambda g, u: None, (g, u)):
                return (target * target).sum()
        _, kept = _kept(run)
        assert any(t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                   for t in kept)


def test_the_target_is_not_kept_alive():
    """Once the caller drops it, the target is freed before the backward pass: nothing the
    block leaves with autograd (the hooks are kept with every saved tensor) refers to it."""
    import gc
    import weakref
    g, u = _inputs()
    p = _formula(g, u)
    ref = weakref.ref(p)
    with saved_as_formula(p, _formula, (g, u)):
        y = (p * p).sum()
    del p
    gc.collect()
    assert ref() is None
    y.backward()
    g2, u2 = _inputs()
    p2 = _formula(g2, u2)
    (p2 * p2).sum().backward()
    assert torch.equal(g.grad, g2.grad)
