"""An RMSNorm that keeps only its input between the passes, for the norms in front of
Float8BlockLinear layers.

In a Hugging Face Llama, ``LlamaRMSNorm.forward`` (transformers 5.x,
``src/transformers/models/llama/modeling_llama.py``, class ``LlamaRMSNorm``) is

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)

and autograd keeps, per norm, the fp32 copy of the input (for ``pow`` and the multiply, 4
bytes per element), the normalized tensor in the model dtype (for the weight multiply, 2
bytes in bf16) and the reciprocal RMS: 6 bytes per element of a bf16 activation, three times
the activation itself. The layers after the norm (q/k/v, gate/up) quantize its output to FP8
and keep only that, so the norm's own saved tensors are most of what the block keeps in high
precision.

:class:`Float8BlockRMSNorm` computes the same formula (the same torch ops, so the same output
bytes, and the consumers' ``quantize(norm(x))`` is unchanged) without grad, keeps only x (in
its dtype: 2 bytes per element in bf16) and the weight (a parameter), and in the backward pass
runs the formula again with grad from x and returns ``torch.autograd.grad`` of it: the same
ops' backward kernels on the same values as autograd's, so dx and dW equal the unconverted
norm's byte for byte. The reciprocal RMS is recomputed with the rest (one read of x that the
backward pass makes anyway); the cost is the forward's elementwise work once more per step.
No fused normalize-and-quantize kernel exists in fp8blk: the output is quantized by the first
consumer, and shared with its siblings through :mod:`fp8blk.torch.linear.sharing`.

Under ``torch.compile`` the module runs the plain formula (inductor's partitioner recomputes
what is cheap by itself, and dynamo does not trace ``torch.autograd.grad`` inside a backward).

Which modules are swapped (:func:`convert_norms`, or ``convert_to_float8_block(...,
norms=True)``): ``torch.nn.RMSNorm`` (formula ``F.rms_norm``), and modules that look like HF's
RMSNorm: a class name ending in ``RMSNorm``, a 1-D ``weight`` parameter, an epsilon attribute
``variance_epsilon`` or ``eps`` (a float), and an output equal byte for byte to the formula
above on a probe input (16 x the width, on the weight's device and in its dtype and in fp32)
-- Llama, Qwen2, Qwen3 (whose q_norm / k_norm normalize each head) and Mistral's norms pass;
a variant (Gemma's ``1 + weight``, an offset, a different cast order) fails the probe and is
left as it is. The state dict is unchanged (``weight``).

    from fp8blk.torch.norm import convert_norms
    convert_norms(model)        # in place; returns the number of norms swapped
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_compiling = torch.compiler.is_compiling


def hf_rms_norm(x, weight, eps):
    """The formula of HF's ``LlamaRMSNorm.forward`` (module docstring), op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def torch_rms_norm(x, weight, eps):
    """``torch.nn.RMSNorm.forward``'s formula (over the last dim)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


FORMULAS = {"hf": hf_rms_norm, "torch": torch_rms_norm}


class _RecomputedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, formula, eps):
        ctx.formula, ctx.eps = formula, eps
        ctx.save_for_backward(x, weight)
        return FORMULAS[formula](x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        # grad mode on here means create_graph=True (double backward): the formula is
        # recomputed on the saved inputs themselves, so the gradients it returns carry their
        # graph back to x and the weight
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            if create_graph:
                xr, wr = x, weight
            else:
                xr = x.detach().requires_grad_(need[0])
                wr = weight.detach().requires_grad_(need[1]) if weight is not None else None
            y = FORMULAS[ctx.formula](xr, wr, ctx.eps)
            inputs = [t for t, n in ((xr, need[0]), (wr, need[1])) if n]
            grads = iter(torch.autograd.grad(y, inputs, dy, create_graph=create_graph)
                         if inputs else ())
        return (next(grads) if need[0] else None), (next(grads) if need[1] else None), \
            None, None


class Float8BlockRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim keeping only its input between the passes (module
    docstring). ``weight`` (width,) or None; ``eps`` a float (None: the "torch" formula's
    default); ``formula`` "hf" or "torch".
    Output: x's shape, in the dtype the formula gives (HF: the weight's and x's promoted;
    torch: as ``F.rms_norm``)."""

    def __init__(self, weight, eps: float, formula: str = "hf"):
        super().__init__()
        if formula not in FORMULAS:
            raise ValueError(f"Float8BlockRMSNorm: formula must be one of {sorted(FORMULAS)}, "
                             f"got {formula!r}")
        self.weight = weight
        self.eps = self.variance_epsilon = None if eps is None else float(eps)
        self.formula = formula

    @classmethod
    def from_norm(cls, module):
        """A Float8BlockRMSNorm sharing `module`'s weight, or None when `module` is not an
        RMSNorm this module reproduces (see :func:`convert_norms`)."""
        if isinstance(module, torch.nn.RMSNorm):
            if len(module.normalized_shape) != 1:
                return None
            # eps None: F.rms_norm's default, the input dtype's machine epsilon
            return cls(module.weight, module.eps, "torch")
        if not type(module).__name__.endswith("RMSNorm"):
            return None
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 \
                or not isinstance(eps, float) or weight.is_meta:
            return None
        new = cls(weight, eps, "hf")
        return new if _same_output(module, new) else None

    def forward(self, x):
        fn = FORMULAS[self.formula]
        if _compiling() or not (torch.is_grad_enabled() and (
                x.requires_grad or (self.weight is not None and self.weight.requires_grad))):
            return fn(x, self.weight, self.eps)
        return _RecomputedNorm.apply(x, self.weight, self.formula, self.eps)

    def extra_repr(self):
        return f"{tuple(self.weight.shape) if self.weight is not None else None}, " \
               f"eps={self.eps}, formula={self.formula!r}"


def _same_output(module, new) -> bool:
    """Whether `module` and `new` give the same bytes on probe inputs (the weight's dtype and
    fp32, 16 rows of random values on the weight's device)."""
    w = new.weight
    gen = torch.Generator(device=w.device).manual_seed(0)
    with torch.no_grad():
        for dtype in dict.fromkeys((w.dtype, torch.float32)):
            x = torch.randn(16, w.shape[0], generator=gen, device=w.device).to(dtype)
            try:
                a, b = module(x), FORMULAS[new.formula](x, w, new.eps)
            except Exception:  # noqa: BLE001  (a module that cannot run alone is not swapped)
                return False
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                return False
    return True


def convert_norms(model: torch.nn.Module, module_filter_fn=None) -> int:
    """Swap every RMSNorm inside `model` (module docstring) for a :class:`Float8BlockRMSNorm`
    sharing its weight, in place; ``module_filter_fn(module, fqn) -> bool`` chooses which.
    Returns the number swapped."""
    count = 0
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{fqn}.{name}" if fqn else name
            if isinstance(child, Float8BlockRMSNorm) or (
                    module_filter_fn is not None and not module_filter_fn(child, full)):
                continue
            new = Float8BlockRMSNorm.from_norm(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


__all__ = ["Float8BlockRMSNorm", "convert_norms", "hf_rms_norm", "torch_rms_norm"]
