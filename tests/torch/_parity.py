"""Test utilities for fp8blk.torch parity tests (TP, SP here; FSDP2 and FSDP2+TP reuse them).

* ``spread(shape, gen)``: data whose rows and columns span orders of magnitude (so every
  block gets its own power-of-two scale and a wrong scale layout or operand shows).
* ``FeedForward``: w1, w2 (column-parallel), out_proj (row-parallel): out_proj(silu(w1 x) * w2 x).
* ``oracle_linear``: a linear layer's forward, dgrad and wgrad from fp8blk's NumPy reference
  (``fb.quantize(...).dequantize()``) and a float64 matmul: independent of fp8blk.torch's
  layout handling, so planted layout bugs fail against it.
* ``Recorder`` + ``check_against_oracle``: every Float8BlockLinear's input, output, output
  gradient and input gradient captured by hooks and checked against the oracle.
* ``LINEARS_ONLY``: ``convert_to_float8_block``'s options all off, the Linear swap alone (its
  default also shares quantizes, swaps norms and MLPs and keeps inputs): for the tests about
  the layer itself.
* ``gamma``, ``order_bound``: the fp32 summation bounds every tolerance here is built from.
* ``full_tensor``, ``dequantized``: helpers for sharded-vs-reference comparisons
  (tests/torch/scripts/tp_parity.py shows a whole parity case: reference model, sharded copy,
  fixed output gradient g so that dL/dy = g exactly on both, comparisons, one SGD step).

Tolerances (derived, never guessed). A dot product of K terms summed in fp32 in any order has
|fl(s) - s| <= gamma_K * sum|a_k b_k| with gamma_K = K u / (1 - K u), u = 2^-24 (Higham,
Accuracy and Stability, 3.1); rounding the result to fp32 adds u |s|. Two fp32 computations of
the same exact products that differ only in summation order (sharded partial sums plus the
reduction across ranks) are therefore within 2 (gamma_K + u) sum|a_k b_k| of each other. With
K <= 1024 this is <= 1.3e-4 relative to sum|a_k b_k|: more than 100x tighter than torchao's
2e-2. The operands' dequantized values are exact in fp32 (FP8 x power-of-two scales), so
sum|a_k b_k| is computed exactly enough in float64 from the same values.
"""
from __future__ import annotations

import math

import torch

import fp8blk as fb
from fp8blk.torch.linear import Float8BlockLinear

U32 = 2.0 ** -24
LINEARS_ONLY = dict(share_quantize=False, norms=False, gated_mlps=False, keep_inputs=False)


def spread(shape, gen: torch.Generator, dtype=torch.float32, decades=(3.0, 2.0)):
    """Gaussian values times 10^U(-r, r) per row and 10^U(-c, c) per column."""
    rows = math.prod(shape[:-1])
    base = torch.randn(rows, shape[-1], generator=gen, dtype=torch.float64)
    r = 10.0 ** ((torch.rand(rows, 1, generator=gen, dtype=torch.float64) * 2 - 1) * decades[0])
    c = 10.0 ** ((torch.rand(1, shape[-1], generator=gen, dtype=torch.float64) * 2 - 1)
                 * decades[1])
    return (base * r * c).reshape(shape).to(dtype)


class FeedForward(torch.nn.Module):
    def __init__(self, d_model, hidden, bias=True, dtype=torch.float32):
        super().__init__()
        self.w1 = torch.nn.Linear(d_model, hidden, bias=bias, dtype=dtype)
        self.w2 = torch.nn.Linear(d_model, hidden, bias=bias, dtype=dtype)
        self.out_proj = torch.nn.Linear(hidden, d_model, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.out_proj(torch.nn.functional.silu(self.w1(x)) * self.w2(x))


def init_spread_(model, gen):
    """Re-draw every parameter with ``spread`` values (scaled to keep activations sane)."""
    with torch.no_grad():
        for p in model.parameters():
            shape = p.shape if p.dim() > 1 else (1, p.shape[0])
            p.copy_(spread(shape, gen, p.dtype).reshape(p.shape) / math.sqrt(p.shape[-1]))


def gamma(n, u=None):
    """gamma_n = n u / (1 - n u): the relative bound of an n-term sum at unit roundoff u
    (Higham 3.1); default u: U32 (fp32's, widened to the tensor cores' by the GPU checks)."""
    u = U32 if u is None else u
    return n * u / (1 - n * u)


def order_bound(a_abs, b_abs_t, k):
    """2 (gamma_K + u) |a| @ |b|: how far two fp32 sums of the same K products, in different
    orders (e.g. per-rank partial sums then a reduction), can be apart, elementwise."""
    return 2 * (gamma(k) + U32) * (a_abs @ b_abs_t)


def full_tensor(t):
    """A DTensor's full value (collective), anything else as it is."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def dequantized(x2d, recipe, direction):
    """float64 values of x2d's FP8 form, "row" or "col" (fp8blk's NumPy reference on the CPU,
    its kernels on the GPU)."""
    return _deq(x2d, recipe, direction)


def _deq(x2d, recipe, direction):
    """fp64 values of x2d's FP8 form in one direction, via fp8blk's NumPy reference."""
    q = fb.quantize(x2d.detach().float().contiguous(), recipe, rowwise=direction == "row",
                    columnwise=direction == "col")
    return q.dequantize(torch.float32).double()


def oracle_linear(x2d, w, dy2d, cfg):
    """{"y", "dx", "dw"}: (value, bound) pairs in float64 for one layer; bound is the
    elementwise dot-product error bound (see module docstring)."""
    xr, wr = _deq(x2d, cfg.activation, "row"), _deq(w, cfg.weight, "row")
    out = {}
    k = x2d.shape[1]
    out["y"] = (xr @ wr.T, (k * U32 / (1 - k * U32) + U32) * (xr.abs() @ wr.abs().T))
    if dy2d is not None:
        n = dy2d.shape[1]
        gr = _deq(dy2d, cfg.grad, "row")
        # W's columnwise values: for Block2D its FP8 transpose (the rowwise values), for
        # MXFP8 its own 32x1 blocks
        wc = _deq(w, cfg.weight, "col")
        out["dx"] = (gr @ wc, (n * U32 / (1 - n * U32) + U32) * (gr.abs() @ wc.abs()))
        gc, xc = _deq(dy2d, cfg.grad, "col"), _deq(x2d, cfg.activation, "col")
        m = x2d.shape[0]
        out["dw"] = (gc.T @ xc, (m * U32 / (1 - m * U32) + U32) * (gc.abs().T @ xc.abs()))
    return out


def assert_within(actual, expected, bound, what, factor=1.0):
    """|actual - expected| <= factor * bound (+ fp32 rounding of expected), elementwise."""
    actual = actual.detach().double()
    excess = (actual - expected).abs() - (factor * bound + U32 * expected.abs())
    if not bool((excess <= 0).all()):
        i = int(torch.argmax(excess))
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements exceed the bound; "
            f"worst at flat index {i}: got {actual.flatten()[i].item():.9g}, expected "
            f"{expected.flatten()[i].item():.9g}, bound {factor * bound.flatten()[i].item():.3g}")


class Recorder:
    """Captures, for each Float8BlockLinear of ``model``: input x, output y, grad of y, grad
    of x (hooks; remove() detaches them). Entries keyed by module name."""

    def __init__(self, model):
        self.data, self.handles = {}, []
        for name, mod in model.named_modules():
            if isinstance(mod, Float8BlockLinear):
                self.handles.append(mod.register_forward_hook(self._fwd(name)))
                self.handles.append(mod.register_full_backward_hook(self._bwd(name)))

    def _fwd(self, name):
        def hook(mod, inputs, output):
            self.data.setdefault(name, {}).update(x=inputs[0].detach().clone(),
                                                  y=output.detach().clone())
        return hook

    def _bwd(self, name):
        def hook(mod, grad_input, grad_output):
            entry = self.data.setdefault(name, {})
            entry["dy"] = grad_output[0].detach().clone()
            entry["dx"] = None if grad_input[0] is None else grad_input[0].detach().clone()
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def check_against_oracle(model, recorder, cfg, check_bias=True):
    """Each recorded layer's y, dx and weight.grad against ``oracle_linear`` (bias added in
    fp32 after the GEMM: y - bias is compared, within one more rounding)."""
    mods = dict(model.named_modules())
    for name, rec in recorder.data.items():
        mod = mods[name]
        k, n = mod.in_features, mod.out_features
        x2d, y2d = rec["x"].reshape(-1, k), rec["y"].reshape(-1, n)
        dy2d = rec["dy"].reshape(-1, n) if "dy" in rec else None
        ref = oracle_linear(x2d, mod.weight.detach(), dy2d, cfg)
        bias = mod.bias.detach().double() if mod.bias is not None else 0.0
        value, bound = ref["y"]
        # mm error bound, then one more fp32 rounding for the bias add
        assert_within(y2d, value + bias, bound + U32 * value.abs(), f"{name} forward")
        if dy2d is not None:
            if rec.get("dx") is not None:
                assert_within(rec["dx"].reshape(-1, k), *ref["dx"], f"{name} input grad")
            if mod.weight.grad is not None:
                assert_within(mod.weight.grad, *ref["dw"], f"{name} weight grad")
            if check_bias and mod.bias is not None and mod.bias.grad is not None:
                m = dy2d.shape[0]
                assert_within(mod.bias.grad, dy2d.double().sum(0),
                              (m * U32 / (1 - m * U32)) * dy2d.double().abs().sum(0),
                              f"{name} bias grad")


def saved_storages(fn):
    """``(fn(), {storage pointer: bytes})``: every storage autograd saves for the backward pass
    while ``fn`` runs, once each (saved_tensors_hooks)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def assert_same(got, want, what):
    """``got`` equals ``want`` byte for byte: tensors (the same dtype and shape; 1-byte dtypes
    such as float8 compared as their bytes), None (equal only to None), or equal-length
    lists/tuples of those. ``what`` names the value in the error."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), \
            f"{what}: {len(got) if isinstance(got, (list, tuple)) else got!r} values, " \
            f"want {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, (what, i))
        return
    if got is None or want is None:
        assert got is None and want is None, \
            f"{what}: got {'None' if got is None else 'a tensor'}, want " \
            f"{'None' if want is None else 'a tensor'}"
        return
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    a, b = got.detach().cpu(), want.detach().cpu()
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    # torch.equal on floats: bitwise except that it treats -0 == 0
    if not torch.equal(a, b):
        bad = (a != b).sum().item()
        raise AssertionError(f"{what}: {bad} mismatches, max |diff| "
                             f"{(a.double() - b.double()).abs().max().item()}")


def set_plant(name):
    """Plant a known bug in fp8blk.torch (for the planted-bug checks); returns an undo
    function. Names: "scale_layout" (1x128 scales read as [m, kb] instead of [kb, m]),
    "dropped_transpose" (dgrad uses W's bytes untransposed instead of its columnwise buffers),
    "wgrad_rowwise" (wgrad uses the rowwise instead of the columnwise buffers)."""
    from fp8blk.torch import scaled_mm
    from fp8blk.torch.linear import functional as linear

    if name == "scale_layout":
        target, attr = scaled_mm, "dequantize_operand"
        orig = scaled_mm.dequantize_operand

        def planted(data, sinv, blocks):
            if blocks != "1x128":
                return orig(data, sinv, blocks)
            rows, k = data.shape
            s = sinv[:, :rows].contiguous().reshape(rows, -1)   # the bug: [m, kb] order
            return data.float() * s.repeat_interleave(128, dim=1)[:, :k]
    elif name == "dropped_transpose":
        target, attr = linear, "weight_transposed"
        orig = linear.weight_transposed

        def planted(qw, recipe):
            # W's FP8 bytes in W's own (N, K) orientation where dgrad needs them transposed
            # (the backward pass holds W's columnwise buffers only: transpose them back)
            data = qw[2].t().contiguous() if qw[2].numel() else qw[0]
            return data, qw[3] if qw[3].numel() else qw[1]
    elif name == "wgrad_rowwise":
        target, attr = linear, "transposed"
        orig = linear.transposed

        def planted(buffers, recipe):
            return buffers[0], buffers[1]
    else:
        raise ValueError(name)
    setattr(target, attr, planted)
    return lambda: setattr(target, attr, orig)


PLANTS = ("scale_layout", "dropped_transpose", "wgrad_rowwise")
