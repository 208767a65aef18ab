"""A gated MLP (SwiGLU) that keeps only the two projections' outputs between the passes.

Hugging Face's ``LlamaMLP.forward`` (transformers 5.x,
``src/transformers/models/llama/modeling_llama.py``; Qwen2's, Qwen3's and Mistral's MLPs are
the same) is

    down_proj(act_fn(gate_proj(x)) * up_proj(x))

and autograd keeps, per layer, the gate output (for the activation), the activation's output
and the up output (for the product), and the down projection's input: four (M, F) tensors
in bf16 (F the intermediate size, 3.5x the hidden size in Llama-3), the largest share of
what a block keeps. With Float8BlockLinear layers the down projection keeps its input as one
FP8 copy (1 byte per element) and the product itself is not kept; :class:`Float8BlockGatedMLP`
also does not keep the activation's output: it computes ``act_fn(g) * u`` without grad and
keeps g and u. For SiLU (``nn.SiLU``, HF's ``ACT2FN["silu"]``) the backward pass calls the
kernels autograd's nodes would (``du = dp * silu(g)``, ``dg = silu_backward(dp * u, g)``):
the activation once more, the product not; for any other activation it runs ``act_fn(g) * u``
again with grad and returns ``torch.autograd.grad`` of it. Either way the same kernels on the
same values as autograd's, so every output and gradient equals the unconverted module's byte
for byte. Cost: the activation once more per step (one read of g, one write; for other
activations the product too). Eager on CUDA the SiLU form's forward and backward each run as
one fp8blk kernel with those bytes (``fp8blk.kernels.silu_gate``; ``KERNELS`` below).

Under ``torch.compile`` the SiLU form runs the same autograd function (plain tensor ops both
ways: the compiled graph holds g and u); other activations run the plain formula (dynamo does
not trace ``torch.autograd.grad`` inside a backward; inductor's partitioner decides).

The down projection. A Float8BlockLinear keeps its input's FP8 copy between the passes (1
byte per element, 112 MiB per layer at Llama-3-8B widths and 8192 tokens). When the down
projection keeps its input instead (``keep_input``, which ``convert_to_float8_block(...,
keep_inputs=True)`` sets), the product is kept as its formula of g and u, which this module
keeps anyway (``fp8blk.torch.recompute.saved_as_formula``): the backward pass makes it again,
with the forward pass's kernels on the same values (the same bytes), and the down projection
quantizes it columnwise; nothing (M, F) is kept for it. Cost: the product once more per step
(two reads, one write) and the columnwise quantize on its own pass. Under ``torch.compile``
the product is computed inside ``torch.utils.checkpoint`` (non-reentrant), which marks its
nodes for inductor's partitioner to recompute in the backward pass: left unmarked, the
partitioner keeps it in bf16 (a tensor an opaque op reads in the backward pass is not
recomputed: ``torch/_functorch/partitioners.py``, "materialized in backward").

Which modules are swapped (:func:`convert_gated_mlps`, or ``convert_to_float8_block``: its
``gated_mlps``, on by default): modules with children ``gate_proj``, ``up_proj``, ``down_proj``
and ``act_fn``, no parameters of their own, whose output equals byte for byte, on a probe input
(4 rows of random values on the weights' device and dtype), the formula above; the state dict
is unchanged (the three projections keep their names). :func:`why_not` says why a module is
left (Phi-3's fused ``gate_up_proj``, an extra factor). On the meta device the probes run on a
CPU copy of the module whose projections are small random stand-ins
(``fp8blk.torch.recompute.probe_twin``: the probe checks the formula, not the widths), so a
model converted on meta swaps the MLPs a real device would, and the SiLU test of the activation
runs on the CPU.

    from fp8blk.torch.mlp import convert_gated_mlps
    convert_gated_mlps(model)        # in place; returns the number swapped
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..kernels import silu_gate as silu_gate_kernels
from .recompute import probe_twin, recomputed_grads, saved_as_formula, swap_children

_compiling = torch.compiler.is_compiling


class _RecomputedGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, act):
        ctx.act = act
        ctx.save_for_backward(g, u)
        return act(g) * u

    @staticmethod
    def backward(ctx, dp):
        g, u = ctx.saved_tensors
        dg, du = recomputed_grads(lambda g, u: ctx.act(g) * u, (g, u),
                                  ctx.needs_input_grad[:2], dp)
        return dg, du, None


# eager on CUDA, the gate runs on fp8blk's one-pass kernels (fp8blk.kernels.silu_gate: torch's
# bytes, one kernel per direction against 2 forward and 4 backward torch kernels, which read
# the experts' strided halves element by element); FP8BLK_GATE_KERNELS=0, or this set False,
# keeps torch's ops
KERNELS = os.environ.get("FP8BLK_GATE_KERNELS", "1") != "0"


def _rows(x):
    """x (..., I) as an (M, I) view, or None where no view is (a copy would cost the pass)."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def _kernels_serve(*tensors):
    """The (M, I) views of `tensors` (plain CUDA tensors, eager) when the one-pass kernels
    take them, else None."""
    if not KERNELS or _compiling() or not tensors[0].is_cuda \
            or any(type(t) is not torch.Tensor for t in tensors):
        return None
    rows = [_rows(t) for t in tensors]
    if any(r is None for r in rows) or not silu_gate_kernels.serves(*rows):
        return None
    return rows


def silu_gate_forward(g, u):
    """``F.silu(g) * u`` (no autograd): one kernel where it serves, else torch's two; the
    same bytes either way."""
    rows = _kernels_serve(g, u)
    if rows is None:
        return F.silu(g) * u
    p = torch.empty(g.shape, dtype=g.dtype, device=g.device)   # a tensor of its own: not a
    silu_gate_kernels.forward(*rows, out=_rows(p))             # view (saved_as_formula)
    return p


class _SiluGate(torch.autograd.Function):
    """``silu(g) * u`` with autograd's backward kernels called directly (MulBackward0's two
    products, SiluBackward0's ``silu_backward``), or fp8blk's one-pass kernels giving their
    bytes: the same bytes, the product not recomputed, no second graph."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return silu_gate_forward(g, u)

    @staticmethod
    def backward(ctx, dp):
        g, u = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: aten.silu_backward has no derivative
            return recomputed_grads(lambda g, u: F.silu(g) * u, (g, u),
                                    ctx.needs_input_grad[:2], dp)
        return silu_gate_backward(g, u, dp, *ctx.needs_input_grad[:2])


def silu_gate_backward(g, u, dp, need_g=True, need_u=True):
    """(dg, du) of ``F.silu(g) * u`` for the output gradient ``dp``, as autograd's kernels
    compute them (MulBackward0's two products, SiluBackward0's ``silu_backward``), in one
    kernel where it serves; None where not needed. Not differentiable (first order)."""
    rows = _kernels_serve(g, u, dp) if need_g and need_u else None
    if rows is not None:
        # fresh outputs of g's shape and dtype: the kernels take their rows as they come
        dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        du = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        silu_gate_kernels.backward(*rows, _rows(dg), _rows(du))
        return dg, du
    du = dp * F.silu(g) if need_u else None
    dg = torch.ops.aten.silu_backward(dp * u, g) if need_g else None
    return dg, du


def silu_gate_backward_cat(h, dp):
    """d h (M, 2I) of ``silu_gate(*h.chunk(2, -1))`` for the output gradient ``dp`` (M, I):
    :func:`silu_gate_backward`'s halves side by side (the chunk's backward), written in place
    by the kernel where it serves, else ``torch.cat`` of them."""
    half = h.shape[-1] // 2
    g, u = h[..., :half], h[..., half:]
    rows = _kernels_serve(g, u, dp)
    if rows is not None:
        # a fresh dh of h's shape: its halves have g's and u's row stride and alignment
        dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        silu_gate_kernels.backward(*rows, _rows(dh[..., :half]), _rows(dh[..., half:]))
        return dh
    return torch.cat(silu_gate_backward(g, u, dp), dim=-1)


def _silu_product(g, u):
    return silu_gate_forward(g, u)


def silu_gate(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` keeping only g and u for the backward pass (not ``silu(g)``), with
    the bytes of autograd's forward and backward kernels (``_SiluGate``); the experts' gating
    (``fp8blk.torch.moe``) uses it too."""
    return _SiluGate.apply(g, u)


def is_silu(act, probe) -> bool:
    """Whether `act` is SiLU: ``F.silu``, a ``torch.nn.SiLU`` (not in place), or a module
    named ``SiLUActivation`` (transformers' ``ACT2FN["silu"]``) giving ``F.silu``'s bytes on
    `probe`."""
    if act is F.silu or (type(act) is torch.nn.SiLU and not act.inplace):
        return True
    if type(act).__name__ != "SiLUActivation" or list(act.parameters()):
        return False
    with torch.no_grad():
        try:
            out = act(probe)
        except Exception:  # noqa: BLE001
            return False
    return isinstance(out, torch.Tensor) and out.dtype == probe.dtype and torch.equal(
        out, F.silu(probe))


class Float8BlockGatedMLP(torch.nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` keeping only the gate and up outputs
    between the passes (module docstring). Children: the projections and activation of the
    module it replaces (shared, not copied)."""

    def __init__(self, gate_proj, up_proj, down_proj, act_fn):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn
        w = _weight(gate_proj)
        # SiLU's backward pass runs without a second graph (module docstring); on the meta
        # device the test runs on the CPU
        device = torch.device("cpu") if w.is_meta else w.device
        self.silu = is_silu(act_fn, torch.randn(
            4, 64, generator=torch.Generator(device=device).manual_seed(1),
            device=device).to(w.dtype))

    @classmethod
    def from_mlp(cls, module):
        """A Float8BlockGatedMLP sharing `module`'s children, or None when `module` is not a
        gated MLP this module reproduces (see :func:`convert_gated_mlps`; :func:`why_not`
        says why)."""
        reason, new = _check(module)
        return new if reason is None else None

    def forward(self, x):
        g = self.gate_proj(x)
        u = self.up_proj(x)
        if not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)):
            return self.down_proj(self.act_fn(g) * u)
        formula = _silu_product if self.silu else self._product
        keep = getattr(self.down_proj, "keep_input", False) is True
        if _compiling():
            if keep:
                # the product marked for recomputation: inductor's partitioner otherwise
                # keeps a tensor the backward pass reads in an opaque op (the down
                # projection's) rather than recompute it
                return self.down_proj(checkpoint(formula, g, u, use_reentrant=False))
            return self.down_proj(_SiluGate.apply(g, u) if self.silu else formula(g, u))
        p = _SiluGate.apply(g, u) if self.silu else _RecomputedGate.apply(g, u, self.act_fn)
        if not keep:
            return self.down_proj(p)
        # a down projection keeping its input keeps the product as its formula of g and u
        with saved_as_formula(p, formula, (g, u)):
            return self.down_proj(p)

    def _product(self, g, u):
        return self.act_fn(g) * u


_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _weight(proj):
    """A projection's weight: ``weight`` (also a PEFT layer's, its base layer's), else its
    first parameter."""
    w = getattr(proj, "weight", None)
    return w if isinstance(w, torch.Tensor) else next(proj.parameters())


def why_not(module) -> str | None:
    """Why :func:`convert_gated_mlps` leaves `module` as it is, in a few words, or None when
    it swaps it (the rules of the module docstring; the conversion report reads them)."""
    return _check(module)[0]


def _check(module):
    """(None, the Float8BlockGatedMLP for `module`) or (why not, None)."""
    parts = [getattr(module, n, None) for n in _PARTS]
    missing = [n for n, p in zip(_PARTS, parts) if not isinstance(p, torch.nn.Module)]
    if missing:
        if isinstance(getattr(module, "gate_up_proj", None), (torch.nn.Module, torch.Tensor)):
            return "fused gate_up_proj", None
        return f"no {', '.join(missing)}", None
    if list(module.parameters(recurse=False)):
        return "parameters of its own", None
    if any(next(p.parameters(), None) is None for p in parts[:3]):
        return "a projection without parameters", None
    new = Float8BlockGatedMLP(*parts)
    probed, probe_new = module, new
    if _weight(parts[0]).is_meta:
        # small CPU stand-ins for the projections (module docstring)
        dtype = _weight(parts[0]).dtype
        stand = {p: torch.nn.Linear(a, b, bias=getattr(p, "bias", None) is not None,
                                    dtype=dtype)
                 for p, (a, b) in zip(parts[:3], ((32, 64), (32, 64), (64, 32)))}
        probed = probe_twin(module, stand)
        probe_new = Float8BlockGatedMLP(*(getattr(probed, n) for n in _PARTS))
    if not _same_output(probed, probe_new):
        return "formula not recognised: output differs from the gated MLP's on a probe", None
    return None, new


def _same_output(module, new) -> bool:
    w = _weight(new.gate_proj)
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(4, w.shape[1], generator=gen, device=w.device).to(w.dtype)
    with torch.no_grad():
        try:
            a, b = module(x), new(x)
        except Exception:  # noqa: BLE001  (a module that cannot run alone is not swapped)
            return False
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def convert_gated_mlps(model: torch.nn.Module, module_filter_fn=None) -> int:
    """Swap every gated MLP inside `model` (module docstring) for a
    :class:`Float8BlockGatedMLP`, in place; ``module_filter_fn(module, fqn) -> bool`` chooses
    which. Returns the number swapped."""
    return swap_children(model, Float8BlockGatedMLP.from_mlp, Float8BlockGatedMLP,
                         module_filter_fn)


__all__ = ["silu_gate", "silu_gate_forward", "silu_gate_backward", "silu_gate_backward_cat",
           "is_silu", "Float8BlockGatedMLP", "convert_gated_mlps", "why_not"]
