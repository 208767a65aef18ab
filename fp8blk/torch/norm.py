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

:class:`Float8BlockRMSNorm` computes the same formula (on torch's ops the same output
bytes, so the consumers' ``quantize(norm(x))`` is unchanged; on the CUDA kernels below the
same bytes but for rare last-bit roundings) and keeps only x (in its dtype:
2 bytes per element in bf16), the weight (a parameter) and the fp32 reciprocal RMS
``r = rsqrt(mean(x**2) + eps)`` (one float per row). For HF's formula the forward pass runs
HF's ops but for one: ``(x.float() * r).to(x.dtype)`` is one ``torch.mul(x, r, out=)``
(computed in fp32, the inputs' common dtype, and rounded to x's dtype on store, as the two ops
round), so 7 kernels against 8; the backward pass is written out, in fp32, with
``g = dy * w`` (rounded once, to fp32) and ``xhat = x * r``:

    dx = r * (g - xhat * mean(g * xhat)) = r * (g - x * (r * r * mean(g * x)))   (to x's dtype)
    dw = sum over rows of dy * xhat.to(x.dtype)    (autograd's own ops for ``weight * n``)

12 aten ops in the backward pass, 8 of them over the whole tensor (about 48 bytes moved per
element of a bf16 activation), against the 24 of running the formula again and asking
autograd for its gradients (CPU ``torch.profiler``, top-level ops without views). On these
ops dw is byte-equal to autograd's; dx differs from autograd's by rounding: autograd rounds
``dy * w`` to the model dtype and sums in another order, so, with
``S = r * (|g| + |xhat| * mean(|g * xhat|))`` (the size of the terms dx is a difference of),
u the unit roundoff of a dtype (2**-8 bf16, 2**-11 fp16, 2**-24 fp32) and D the width, each
element of dx is within ``(u_x + D * u_fp32) * S`` of the exact gradient and within
``(u_g + 2 * u_x + 2 * (D + 8) * u_fp32) * S`` of autograd's (``u_g``: of ``dy * w``'s dtype),
about one unit in the last place of bf16 where dx does not cancel. ``exact_grad=True``
(:func:`convert_norms`) keeps the gradients byte-equal to autograd's instead: the backward
pass runs the formula again with grad from x and returns ``torch.autograd.grad`` of it (the
same ops' backward kernels on the same values), at about twice the backward cost; the
"torch" formula (``torch.nn.RMSNorm``) always takes that path. The output is quantized by
its first consumer and shared with its siblings through :mod:`fp8blk.torch.linear.sharing`.

Eager on CUDA, HF's formula runs on fp8blk's one-pass kernels (:mod:`fp8blk.kernels.rms_norm`:
one kernel per direction, against 7 torch kernels forward and 12 backward; timings in
bench/README.md, ``bench/bench_norm.py``) when x and the weight are plain CUDA tensors of one dtype, x
C-contiguous, the width a multiple of 8 (4 in fp32) up to 16384 (2-byte dtypes; 8192 in fp32),
16-byte aligned; anything else takes the torch ops above. Their numerics (bounds checked in
tests/kernels/_rms_norm_checks.py): r is the formula's but for the order of the fp32 sum of
squares (within (D + 8) u_fp32 relative of the exact value; a few ulp from torch's); given r,
y is exactly HF's ``weight * (x * r).to(dtype)``, so it differs from torch's ops only where
the two r round ``x * r`` to different neighbours (under 0.1% of the elements, at most two
units of y in the last place); dx is within ``(u_x + (D + 8) u_fp32) S`` (plus half a
subnormal step of x's dtype) of the exact gradient; dw is summed in fp32 per group of
rows, then over the groups (a fixed order: deterministic), within ``M u_fp32 sum|p|`` of the
exact sum of ``p = dy * (x * r).to(dtype)`` rounded, as autograd rounds it, instead of
autograd's bytes. ``KERNELS = False`` (or ``FP8BLK_NORM_KERNELS=0``) keeps torch's ops.

Under ``torch.compile`` HF's formula runs the same autograd function (its backward pass is
plain tensor ops, so the compiled graph holds x and r and fuses both passes); the "torch"
formula and ``exact_grad=True`` run the plain formula (dynamo does not trace
``torch.autograd.grad`` inside a backward; inductor's partitioner chooses what to keep).

Which modules are swapped (:func:`convert_norms`, or ``convert_to_float8_block``: its
``norms``, on by default): ``torch.nn.RMSNorm`` (formula ``F.rms_norm``), and modules that look
like HF's RMSNorm: a class name ending in ``RMSNorm``, a 1-D ``weight`` parameter, an epsilon
attribute ``variance_epsilon`` or ``eps`` (a float), and an output equal byte for byte to the
formula above on a probe input (16 x the width, on the weight's device and in its dtype and in
fp32) -- Llama, Qwen2, Qwen3 (whose q_norm / k_norm normalize each head) and Mistral's norms
pass; a variant (Gemma's ``1 + weight``, an offset, a different cast order) fails the probe and
is left as it is (:func:`why_not` says why). On the meta device the probe runs on a CPU copy of
the module with random values (``fp8blk.torch.recompute.probe_twin``), so a model converted on
meta swaps the norms a real device would. The state dict is unchanged (``weight``).

    from fp8blk.torch.norm import convert_norms
    convert_norms(model)        # in place; returns the number of norms swapped
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..kernels import rms_norm
from .recompute import probe_twin, recomputed_grads, swap_children

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
    """Any formula: the backward pass runs it again with grad and returns autograd's
    gradients of it (the same kernels on the same values as the unconverted norm's)."""

    @staticmethod
    def forward(ctx, x, weight, formula, eps):
        ctx.formula, ctx.eps = formula, eps
        ctx.save_for_backward(x, weight)
        return FORMULAS[formula](x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = recomputed_grads(lambda x, w: FORMULAS[ctx.formula](x, w, ctx.eps),
                                  (x, weight), ctx.needs_input_grad[:2], dy)
        return dx, dw, None, None


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# the one-pass CUDA kernels for HF's formula (module docstring); FP8BLK_NORM_KERNELS=0, or
# this set False, keeps torch's ops (HF's exact bytes in the forward pass)
KERNELS = os.environ.get("FP8BLK_NORM_KERNELS", "1") != "0"


def _kernels_serve(x, weight):
    """Whether the one-pass CUDA kernels (``fp8blk.kernels.rms_norm``) run this norm: eager,
    plain CUDA tensors of one dtype, x C-contiguous, a width the kernels take."""
    return (KERNELS and x.is_cuda and type(x) is torch.Tensor and type(weight) in _PLAIN
            and weight.device == x.device and x.is_contiguous()
            and not _compiling()
            and rms_norm.serves(x.view(-1, x.shape[-1]), weight))


class _HFNorm(torch.autograd.Function):
    """HF's formula with its backward pass written out (module docstring): saves x, the
    weight and the fp32 reciprocal RMS r (x's shape with a last dim of 1)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.eps = eps
        ctx.kernels = _kernels_serve(x, weight)
        if ctx.kernels:
            y, r = rms_norm.forward(x.view(-1, x.shape[-1]), weight, eps)
            r = r.view(*x.shape[:-1], 1)
            ctx.save_for_backward(x, weight, r)
            return y.view(x.shape)
        r = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * _normalized(x, r)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (double backward): autograd's gradients of the formula, which
            # carry their graph (the analytic form below writes into out= buffers)
            dx, dw = recomputed_grads(lambda x, w: FORMULAS["hf"](x, w, ctx.eps), (x, weight),
                                      ctx.needs_input_grad[:2], dy)
            return dx, dw, None
        dx = dw = None
        if ctx.kernels:
            d = x.shape[-1]
            dy2d = dy.reshape(-1, d)
            if not dy2d.is_contiguous() or dy2d.data_ptr() % 16:
                dy2d = dy2d.clone(memory_format=torch.contiguous_format)
            dx, dw_part = rms_norm.backward(x.view(-1, d), weight, dy2d, r.view(-1))
            if ctx.needs_input_grad[1]:
                dw = dw_part.sum(0).to(weight.dtype)
            return (dx.view(x.shape) if ctx.needs_input_grad[0] else None), dw, None
        if _compiling():
            # traced, the out= buffers below do not fix dx's layout: dx would take dY's
            # strides (Qwen3's per-head norms get a transposed dY), which the traced view
            # backward of a layer before the norm cannot take
            dy = dy.contiguous()
        if ctx.needs_input_grad[0]:
            g = dy * weight.to(torch.float32)            # fp32, one rounding
            # mean(g * xhat) = r * mean(g * x): dx = r * (g - x * (r * r * mean(g * x)))
            c = (g * x).mean(-1, keepdim=True).mul_(r * r)
            dx = torch.mul(torch.addcmul(g, x, c, value=-1), r, out=torch.empty_like(x))
        if ctx.needs_input_grad[1]:
            # autograd's MulBackward0 and sum_to on the forward's normalized tensor
            dw = (dy * _normalized(x, r)).sum(tuple(range(dy.dim() - 1))).to(weight.dtype)
        return dx, dw, None


def _normalized(x, r):
    """``(x.to(float32) * r).to(x.dtype)`` in one kernel: the product is computed in fp32
    (the inputs' common dtype) and rounded once to fp32, then to x's dtype on store, as the
    two ops do."""
    return torch.mul(x, r, out=torch.empty_like(x))


class Float8BlockRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim keeping only its input between the passes (module
    docstring). ``weight`` (width,) or None; ``eps`` a float (None: the "torch" formula's
    default); ``formula`` "hf" or "torch".
    Output: x's shape, in the dtype the formula gives (HF: the weight's and x's promoted;
    torch: as ``F.rms_norm``)."""

    def __init__(self, weight, eps: float, formula: str = "hf", exact_grad: bool = False):
        super().__init__()
        if formula not in FORMULAS:
            raise ValueError(f"Float8BlockRMSNorm: formula must be one of {sorted(FORMULAS)}, "
                             f"got {formula!r}")
        self.weight = weight
        self.eps = self.variance_epsilon = None if eps is None else float(eps)
        self.formula = formula
        self.exact_grad = bool(exact_grad)

    @classmethod
    def from_norm(cls, module, exact_grad: bool = False):
        """A Float8BlockRMSNorm sharing `module`'s weight, or None when `module` is not an
        RMSNorm this module reproduces (see :func:`convert_norms`; :func:`why_not` says why)."""
        if why_not(module) is not None:
            return None
        if isinstance(module, torch.nn.RMSNorm):
            # eps None: F.rms_norm's default, the input dtype's machine epsilon
            return cls(module.weight, module.eps, "torch", exact_grad)
        return cls(module.weight, _eps(module), "hf", exact_grad)

    def forward(self, x):
        fn = FORMULAS[self.formula]
        if not (torch.is_grad_enabled() and (
                x.requires_grad or (self.weight is not None and self.weight.requires_grad))):
            return fn(x, self.weight, self.eps)
        if self.formula == "hf" and not self.exact_grad:
            return _HFNorm.apply(x, self.weight, self.eps)
        if _compiling():
            return fn(x, self.weight, self.eps)
        return _RecomputedNorm.apply(x, self.weight, self.formula, self.eps)

    def extra_repr(self):
        return f"{tuple(self.weight.shape) if self.weight is not None else None}, " \
               f"eps={self.eps}, formula={self.formula!r}, exact_grad={self.exact_grad}"


def _eps(module):
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


def why_not(module) -> str | None:
    """Why :func:`convert_norms` leaves `module` as it is, in a few words, or None when it
    swaps it (the rules of the module docstring; the conversion report reads them)."""
    if isinstance(module, torch.nn.RMSNorm):
        return None if len(module.normalized_shape) == 1 else "normalizes over several dims"
    name = type(module).__name__
    if not name.endswith("RMSNorm"):
        return "not an RMSNorm: no fp8blk path"
    weight, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        return "no 1-D weight parameter"
    if not isinstance(eps, float):
        return "no float variance_epsilon or eps"
    if weight.is_meta:
        # on the meta device the probe runs on a CPU stand-in (``recompute.probe_twin``)
        module = probe_twin(module)
        weight = module.weight
    return _probe(module, weight, _eps(module))


def _probe(module, w, eps) -> str | None:
    """None when `module` gives HF's formula's bytes on probe inputs (the weight's dtype and
    fp32, 16 rows of random values on the weight's device), else what differs."""
    gen = torch.Generator(device=w.device).manual_seed(0)
    with torch.no_grad():
        for dtype in dict.fromkeys((w.dtype, torch.float32)):
            x = torch.randn(16, w.shape[0], generator=gen, device=w.device).to(dtype)
            try:
                a, b = module(x), hf_rms_norm(x, w, eps)
            except Exception as err:  # noqa: BLE001  (a module that cannot run alone: left)
                return f"cannot run alone on a probe input: {type(err).__name__}"
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                # Gemma's form, x * r * (1 + weight) in fp32, named: the commonest variant
                h = x.float()
                gemma = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())
                if a.shape == gemma.shape and torch.allclose(a.float(), gemma, rtol=2e-2,
                                                             atol=1e-3):
                    return "(1 + weight) form not recognised"
                return "formula not recognised: output differs from HF's RMSNorm on a probe"
    return None


def convert_norms(model: torch.nn.Module, module_filter_fn=None, exact_grad: bool = False
                  ) -> int:
    """Swap every RMSNorm inside `model` (module docstring) for a :class:`Float8BlockRMSNorm`
    sharing its weight, in place; ``module_filter_fn(module, fqn) -> bool`` chooses which;
    ``exact_grad``: gradients byte-equal to autograd's (the recomputing backward pass).
    Returns the number swapped."""
    return swap_children(model, lambda child: Float8BlockRMSNorm.from_norm(child, exact_grad),
                         Float8BlockRMSNorm, module_filter_fn)


__all__ = ["Float8BlockRMSNorm", "convert_norms", "hf_rms_norm", "torch_rms_norm", "why_not"]
