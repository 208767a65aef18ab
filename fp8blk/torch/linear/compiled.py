"""Float8BlockLinear's per-signature plan as torch ops, for torch.compile.

Under torch.compile a layer otherwise traces through its pieces -- quantize x, quantize W,
the GEMM; then quantize dY, W's columnwise form, two GEMMs -- and each piece is a Python custom
op, whose call inside a compiled graph costs tens of microseconds of host time, while the
pieces' own Python runs as on the general path. Where a plan serves the signature
(``plans.traceable``: plain CUDA weights, Block1D/Block2D, any non-empty shape), the layer
instead calls two ops in the forward pass and one in the backward pass, registered with
``Library.define`` + ``impl`` (which skips the high-level custom-op API's autograd and
aliasing wrappers), each running the eager hot path's plan (``plans.plan_for_shapes``,
``plans.x_views``), so the compiled layer computes the same bytes as the eager one:

    fp8blk::linear_quantize_x(x, cfg, need_wgrad) -> (xd, xs, xt_d, xt_s)
    fp8blk::linear_fwd_mm(xd, xs, weight, cfg, x_dtype, out_dtype, need_dgrad, need_wgrad)
        -> y
    fp8blk::linear_bwd(dy, xt_d, xt_s, weight, cfg, x_dtype, need_dgrad, need_wgrad)
        -> (dx, dw)

(``low_memory_forward``: ``fp8blk::linear_fwd(x, weight, cfg, out_dtype, need_dgrad,
need_wgrad) -> (y, xt_d, xt_s)`` in place of the first two). A layer that keeps its input
(``keep_input``) quantizes x rowwise only in the forward pass (``need_wgrad=False`` in
``linear_quantize_x`` / ``linear_fwd``), and its backward pass takes x in place of its
columnwise copy, making that copy itself:

    fp8blk::linear_bwd_x(dy, x, weight, cfg, x_dtype, need_dgrad, need_wgrad) -> (dx, dw)

x's quantization is inside the op that reads dY on purpose: as an op of its own, needing only
x, the partitioner would run it in the forward pass and keep its output (an op it may not
recompute, reachable from the forward inputs alone, lands on the forward side of the cut).
This way the backward pass needs x itself, and inductor's partitioner either keeps x (free
where x is kept anyway, e.g. attention's output) or recomputes it from what the graph keeps
(a norm's output from its input, a gated MLP's product from the gate and up outputs). x's quantization is an op of
its own, depending on x and the activation recipe only, so the layers reading one x (q/k/v,
gate/up) make identical nodes that the graph's CSE merges (``sharing``). x (M, K) and dy
(M, N) C-contiguous, weight (N, K); y (M, N) `out_dtype`; xd, xs: x's rowwise FP8 data and
scales as ``plans.x_views`` gives them; xt_d, xt_s: x's columnwise FP8 data as the plan
holds it, (M, K) float8 with strides (1, M), and its (cdiv(M, 128), round4(K)) float32 scales
(empty (0,) uint8 tensors when the weight gradient is not needed); dx (M, K) `x_dtype`, dw
(N, K) in the weight's dtype (empty where not needed). ``cfg`` is :func:`config_key` of the
layer's Float8BlockConfig. An x or weight that is not C-contiguous and 16-byte aligned (the
plans' launchers assume both) is copied first (dy as the eager plan treats it).
"""
from __future__ import annotations

import torch

from ..._bounded import BoundedCache
from ...layout import cdiv, round_up
from ...ops import quantize_launcher
from ..config import Float8BlockConfig, fp8_dtype
from ...formats import recipe_from_key, recipe_key
from . import plans

_CONFIGS = {}


def config_key(cfg: Float8BlockConfig) -> str:
    """A string naming the config exactly (ops take no Python objects)."""
    return "|".join([recipe_key(r) for r in (cfg.activation, cfg.weight, cfg.grad)]
                    + (["low_memory_forward"] if cfg.low_memory_forward else []))


def _config(key):
    cfg = _CONFIGS.get(key)
    if cfg is None:
        parts = key.split("|")
        cfg = _CONFIGS[key] = Float8BlockConfig(*(recipe_from_key(p) for p in parts[:3]),
                                                low_memory_forward=len(parts) > 3)
    return cfg


def _ready(t):
    """`t` if C-contiguous and 16-byte aligned, else a copy that is."""
    if t.is_contiguous() and not t.data_ptr() & 15:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _none(device):
    return torch.empty((0,), dtype=torch.uint8, device=device)


def _fwd(x, weight, cfg, out_dtype, need_dgrad, need_wgrad):
    x, weight = _ready(x), _ready(weight)
    (m, k), n = x.shape, weight.shape[0]
    plan = plans.plan_for_shapes(m, k, n, x.dtype, weight.dtype, x.device, _config(cfg),
                                 out_dtype, need_dgrad, need_wgrad)
    y, (xt_d, xt_s) = plan.forward(x, weight)
    if xt_d is None:            # distinct empties: an op's outputs must not alias
        xt_d, xt_s = _none(x.device), _none(x.device)
    return y, xt_d, xt_s


def _fwd_fake(x, weight, cfg, out_dtype, need_dgrad, need_wgrad):
    (m, k), n = x.shape, weight.shape[0]
    y = x.new_empty((m, n), dtype=out_dtype)
    if not need_wgrad:
        return y, x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.uint8)
    fa = fp8_dtype(_config(cfg).activation.fmt)
    return (y, torch.empty_strided((m, k), (1, m), dtype=fa, device=x.device),
            x.new_empty((cdiv(m, 128), round_up(k, 4)), dtype=torch.float32))


_x_launchers = BoundedCache(1024)   # (m, k, dtype, device, cfg, columnwise) -> launcher


def _quantize_x(x, cfg, need_wgrad):
    x = _ready(x)
    (m, k), c = x.shape, _config(cfg)
    key = (m, k, x.dtype, x.device, c, need_wgrad)
    launch = _x_launchers.get(key)
    if launch is None:
        launch = _x_launchers.put(key, quantize_launcher(
            x, c.activation, True, need_wgrad, plans.x_views(m, k, c, need_wgrad)))
    xd, xs, xt_d, xt_s = launch(x, x.data_ptr())
    if xt_d is None:
        xt_d, xt_s = _none(x.device), _none(x.device)
    return xd, xs, xt_d, xt_s


def _quantize_x_fake(x, cfg, need_wgrad):
    (m, k), c = x.shape, _config(cfg)
    out = [None if v is None else torch.empty_strided(v[0], v[1], dtype=v[2], device=x.device)
           for v in plans.x_views(m, k, c, need_wgrad)]
    return tuple(t if t is not None else x.new_empty((0,), dtype=torch.uint8) for t in out)


def _fwd_mm(xd, xs, weight, cfg, x_dtype, out_dtype, need_dgrad, need_wgrad):
    weight = _ready(weight)
    (m, k), n = xd.shape, weight.shape[0]
    plan = plans.plan_for_shapes(m, k, n, x_dtype, weight.dtype, xd.device, _config(cfg),
                                 out_dtype, need_dgrad, need_wgrad)
    if plan.lean is not None:   # W's FP8 copy and the workspace in the scratch arena
        y = plan.lean.forward_mm(xd, xs, weight)
        if y is not None:
            return y
    wd, ws = plan.qw(weight, weight.data_ptr())[:2]
    return plan.mm_fwd(xd, wd, xs, ws)


def _fwd_mm_fake(xd, xs, weight, cfg, x_dtype, out_dtype, need_dgrad, need_wgrad):
    return xd.new_empty((xd.shape[0], weight.shape[0]), dtype=out_dtype)


def _bwd(dy, xt_d, xt_s, weight, cfg, x_dtype, need_dgrad, need_wgrad):
    weight = _ready(weight)     # dy: made contiguous by the layer, aligned by plan.backward
    (m, n), k = dy.shape, weight.shape[1]
    plan = plans.plan_for_shapes(m, k, n, x_dtype, weight.dtype, dy.device, _config(cfg),
                                 dy.dtype, need_dgrad, need_wgrad)
    dx, dw = plan.backward(dy, xt_d, xt_s, weight, need_dgrad, need_wgrad)
    return (_none(dy.device) if dx is None else dx), (_none(dy.device) if dw is None else dw)


def _bwd_x(dy, x, weight, cfg, x_dtype, need_dgrad, need_wgrad):
    # the keep_input plan makes x's columnwise copy from x (its lean path in the launch of
    # dY's and W's copies)
    x, weight = _ready(x), _ready(weight)
    (m, k), n = x.shape, weight.shape[0]
    plan = plans.plan_for_shapes(m, k, n, x_dtype, weight.dtype, x.device, _config(cfg),
                                 dy.dtype, need_dgrad, need_wgrad, keep_input=True)
    dx, dw = plan.backward(dy, None, None, weight, need_dgrad, need_wgrad, x)
    return (_none(dy.device) if dx is None else dx), (_none(dy.device) if dw is None else dw)


def _bwd_x_fake(dy, x, weight, cfg, x_dtype, need_dgrad, need_wgrad):
    return _bwd_fake(dy, None, None, weight, cfg, x_dtype, need_dgrad, need_wgrad)


def _bwd_fake(dy, xt_d, xt_s, weight, cfg, x_dtype, need_dgrad, need_wgrad):
    (m, n), k = dy.shape, weight.shape[1]
    none = dy.new_empty((0,), dtype=torch.uint8)
    return (dy.new_empty((m, k), dtype=x_dtype) if need_dgrad else none,
            dy.new_empty((n, k), dtype=weight.dtype) if need_wgrad else none.clone())


_lib = torch.library.Library("fp8blk", "FRAGMENT")
_lib.define("linear_fwd(Tensor x, Tensor weight, str cfg, ScalarType out_dtype, "
            "bool need_dgrad, bool need_wgrad) -> (Tensor, Tensor, Tensor)")
_lib.define("linear_bwd(Tensor dy, Tensor xt_d, Tensor xt_s, Tensor weight, str cfg, "
            "ScalarType x_dtype, bool need_dgrad, bool need_wgrad) -> (Tensor, Tensor)")
_lib.define("linear_quantize_x(Tensor x, str cfg, bool need_wgrad) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_lib.define("linear_bwd_x(Tensor dy, Tensor x, Tensor weight, str cfg, ScalarType x_dtype, "
            "bool need_dgrad, bool need_wgrad) -> (Tensor, Tensor)")
_lib.define("linear_fwd_mm(Tensor xd, Tensor xs, Tensor weight, str cfg, ScalarType x_dtype, "
            "ScalarType out_dtype, bool need_dgrad, bool need_wgrad) -> Tensor")
_lib.impl("linear_fwd", _fwd, "CUDA")
_lib.impl("linear_quantize_x", _quantize_x, "CUDA")
_lib.impl("linear_bwd_x", _bwd_x, "CUDA")
_lib.impl("linear_fwd_mm", _fwd_mm, "CUDA")
_lib.impl("linear_bwd", _bwd, "CUDA")
torch.library.register_fake("fp8blk::linear_fwd", _fwd_fake, lib=_lib)
torch.library.register_fake("fp8blk::linear_bwd", _bwd_fake, lib=_lib)
torch.library.register_fake("fp8blk::linear_quantize_x", _quantize_x_fake, lib=_lib)
torch.library.register_fake("fp8blk::linear_bwd_x", _bwd_x_fake, lib=_lib)
torch.library.register_fake("fp8blk::linear_fwd_mm", _fwd_mm_fake, lib=_lib)


def forward(x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad, keep_input=False):
    """``(y, (xt_d, xt_s))`` through ``fp8blk::linear_quantize_x`` and
    ``fp8blk::linear_fwd_mm`` (``low_memory_forward``: ``fp8blk::linear_fwd``); `xt_*` None
    when not needed or `keep_input` (then :func:`backward` takes x in their place)."""
    key = config_key(cfg)
    save = need_wgrad and not keep_input
    if cfg.low_memory_forward:
        y, xt_d, xt_s = torch.ops.fp8blk.linear_fwd(x2d, weight, key, out_dtype, need_dgrad,
                                                    save)
    else:
        xd, xs, xt_d, xt_s = torch.ops.fp8blk.linear_quantize_x(x2d, key, save)
        y = torch.ops.fp8blk.linear_fwd_mm(xd, xs, weight, key, x2d.dtype, out_dtype,
                                           need_dgrad, need_wgrad)
    return y, ((xt_d, xt_s) if save else (None, None))



def backward(dy2d, xt_d, xt_s, weight, cfg, x_dtype, planned, need_dgrad, need_wgrad,
             x2d=None):
    """``(dx, dw)`` through ``fp8blk::linear_bwd`` (None where not needed); with `x2d` (a
    layer keeping its input), through ``fp8blk::linear_bwd_x`` from x itself. ``planned``:
    the forward call's (need_dgrad, need_wgrad), which name its plan."""
    if x2d is not None:
        dx, dw = torch.ops.fp8blk.linear_bwd_x(dy2d, x2d, weight, config_key(cfg), x_dtype,
                                               *planned)
    else:
        if xt_d is None:
            xt_d = xt_s = dy2d.new_empty((0,), dtype=torch.uint8)
        dx, dw = torch.ops.fp8blk.linear_bwd(dy2d, xt_d, xt_s, weight, config_key(cfg),
                                             x_dtype, *planned)
    return (dx if need_dgrad else None), (dw if need_wgrad else None)
