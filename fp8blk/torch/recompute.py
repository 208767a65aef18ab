"""What the memory-saving modules (``norm``, ``mlp``) share: gradients of a formula
recomputed in backward, so that what they keep between the passes is only the formula's
inputs; a tensor saved by a layer kept as the formula that makes it (:func:`saved_as_formula`);
and the in-place swap of a model's submodules for them, with the CPU stand-in on which a
module built on the meta device is probed (:func:`probe_twin`)."""
from __future__ import annotations

import contextlib
import copy
import itertools

import torch

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def recomputed_grads(formula, inputs, needs, grad_output):
    """Autograd's gradients of ``formula(*inputs)`` against ``grad_output``, one entry per
    input (None where ``needs`` says it is not wanted, or the input is None), from a backward
    pass. Grad mode on in backward means ``create_graph=True`` (double backward): the formula
    then runs on the saved inputs themselves, so the gradients carry their graph back to
    them; otherwise on detached copies."""
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        if create_graph:
            leaves = list(inputs)
        else:
            leaves = [None if t is None else t.detach().requires_grad_(bool(n))
                      for t, n in zip(inputs, needs)]
        out = formula(*leaves)
        wanted = [t for t, n in zip(leaves, needs) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, create_graph=create_graph)
                     if wanted else ())
    return tuple(next(grads) if n and t is not None else None for t, n in zip(leaves, needs))


class _Recipe:
    """A saved tensor kept as ``formula(*inputs)``: the inputs (packed by the hooks outside,
    if any), their version counters, and the saved view's geometry within the result."""

    __slots__ = ("formula", "inputs", "versions", "view", "outer")

    def __init__(self, formula, inputs, view, outer):
        self.formula, self.view, self.outer = formula, view, outer
        # outer hooks answer for what they pack (a checkpoint's recomputed inputs are new
        # tensors, with counters of their own)
        self.versions = None if outer else [t._version for t in inputs]
        self.inputs = [outer[0](t) for t in inputs] if outer else list(inputs)


@contextlib.contextmanager
def saved_as_formula(target, formula, inputs):
    """Inside the block, autograd keeps `target` -- wherever an op saves it or a view of it
    for backward -- as the recipe ``formula(*inputs)``, run again (without grad) when the
    backward pass unpacks it: what is kept between the passes is `inputs`, which the caller
    keeps anyway. `formula` must give `target`'s bytes again from the same inputs (the same
    ops on the same values); an in-place change of an input before then raises, as autograd's
    own version check would. `target` a plain tensor that owns its storage (else the block
    changes nothing). Hooks already installed (``torch.utils.checkpoint``, offloading,
    a counter) still see every other saved tensor, and the recipe's inputs in place of
    `target`.

        import torch
        from fp8blk.torch.recompute import saved_as_formula
        g = torch.randn(8, 16, requires_grad=True)
        p = torch.nn.functional.silu(g)
        with saved_as_formula(p, torch.nn.functional.silu, (g,)):
            y = p.exp()                      # exp keeps its output, not p: nothing changes
            z = (p * p).sum()                # mul keeps p: kept as silu(g)
        z.backward()
    """
    if type(target) is not torch.Tensor or target._base is not None \
            or not target.is_contiguous():
        yield
        return
    outer = _top_hooks(True)
    # the hooks hold no reference to target: autograd keeps them with every tensor saved in
    # the block, so one would keep target alive until the backward pass
    storage, dtype = target.untyped_storage().data_ptr(), target.dtype
    base = target.storage_offset()
    del target

    def pack(t):
        if t.dtype == dtype and t.untyped_storage().data_ptr() == storage:
            return _Recipe(formula, inputs, (t.size(), t.stride(), t.storage_offset() - base),
                           outer)
        return outer[0](t) if outer else t

    def unpack(obj):
        if type(obj) is not _Recipe:
            return outer[1](obj) if outer else obj
        ins = [obj.outer[1](t) for t in obj.inputs] if obj.outer else obj.inputs
        if obj.versions is not None and [t._version for t in ins] != obj.versions:
            raise RuntimeError("an input of a recomputed saved tensor (fp8blk.torch.recompute."
                               "saved_as_formula) was modified by an inplace operation before "
                               "the backward pass")
        with torch.no_grad():
            out = obj.formula(*ins)
        return out.as_strided(*obj.view)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def swap_children(model, build, kind, module_filter_fn=None) -> int:
    """Replace, in place, every submodule ``child`` of `model` (at any depth) for which
    ``build(child)`` returns a module; modules already of type ``kind`` and those
    ``module_filter_fn(child, fqn)`` rejects are left. Returns the number replaced."""
    count = 0
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{fqn}.{name}" if fqn else name
            if isinstance(child, kind) or (
                    module_filter_fn is not None and not module_filter_fn(child, full)):
                continue
            new = build(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


def probe_twin(module, stand_ins=None):
    """A CPU copy of `module` (built on the meta device) for the swaps' probes: the same
    classes and attributes, every parameter and floating buffer drawn from a fixed seed
    (integer buffers zero), and each module of ``stand_ins`` ({original: replacement})
    replaced. A meta tensor has no values to run a probe on; the probe checks a formula, which
    the values do not change, so the same rule decides on meta as on a real device (random
    values tell a formula from its variants at least as well as initialized ones: a weight of
    ones hides a missing multiply)."""
    memo = {id(k): v for k, v in (stand_ins or {}).items()}
    twin = copy.deepcopy(module, memo)
    twin.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in itertools.chain(twin.parameters(), twin.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            else:
                t.zero_()
    return twin
