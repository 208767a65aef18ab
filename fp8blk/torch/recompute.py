"""What the memory-saving modules (``norm``, ``mlp``) share: gradients of a formula
recomputed in backward, so that what they keep between the passes is only the formula's
inputs, and the in-place swap of a model's submodules for them."""
from __future__ import annotations

import torch


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
