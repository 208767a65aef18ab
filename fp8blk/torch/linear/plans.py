"""The eager CUDA hot path of Float8BlockLinear: one plan per call signature.

A Float8BlockLinear step on the general path (``functional``) validates every operand, wraps
each quantized operand in a BlockTensor, views its buffers as ``torch._scaled_mm`` wants them
and checks the GEMM layouts. A plan does the same arithmetic with what only depends on the
signature worked out once: each quantize launcher (``fp8blk.ops.quantize_launcher``)
allocates its outputs directly in the dtype and strides the GEMM takes (FP8 data as float8,
scale buffers transposed: the same bytes as docs/layouts.md, seen another way), so a step is
four quantize launches, three GEMM calls and the autograd bookkeeping (``low_memory_forward``:
five and four, its forward pass in halves; :class:`LinearPlan`); the lean path below runs the
four quantizes in two launches.

Signatures a plan serves (everything else takes the general path): plain CUDA tensors (x a
``torch.Tensor``, the weight a ``torch.Tensor`` or ``nn.Parameter``, so not the FSDP2 FP8
weight), Block1D/Block2D configs, x (M, K) and W (N, K) of any non-empty shape, 16-byte
aligned operands, float32/bfloat16/float16. Each GEMM runs on cuBLASLt directly
(``fp8blk.torch._cublaslt.ScaledMM``: torch's algorithm, found once per signature) where it
serves the signature (the GEMM's M, N and K multiples of 16: any K-block count, e.g. 8000
tokens or 11008 features, with no padding), else through ``scaled_mm.cuda_scaled_mm``
(``torch._scaled_mm``, on zero-padded copies where its kernel needs them: K not a multiple of
512, rows not of 4, N not of 16); ``FP8BLK_CUBLASLT=0`` keeps them on ``torch._scaled_mm``.
The bytes are the general path's: the same kernels on the same inputs, the same GEMMs on the
same bytes (tests/torch/linear/test_plans.py compares them on the GPU).

On the device's default stream a plan runs lean (:class:`_Lean`): its transient buffers in
the thread's scratch arena for that stream (fp8blk/torch/_arena.py), the launches and GEMMs
on raw addresses; elsewhere (side streams, CUDA-graph capture and warm-up) it allocates.

Plans are keyed by the signature (:func:`plan_for`); :data:`plans` keeps the 1024 used last.
Under torch.compile the layer's two ops (``compiled``) hold no x in backward, so they key
plans by shapes and dtypes instead (:func:`plan_for_shapes`, :data:`shape_plans`, bounded the
same way).
"""
from __future__ import annotations

import functools
import threading

import torch

from ... import _arrays
from ..._bounded import BoundedCache
from ...formats import MXFP8
from ...layout import cdiv, round_up
from ...ops import quantize_group_site, quantize_launcher
from .. import _arena, _cublaslt
from ..config import HIGH_DTYPES, fp8_dtype
from ..scaled_mm import cuda_scaled_mm

_WEIGHT_TYPES = (torch.Tensor, torch.nn.Parameter)

plans = BoundedCache(1024)        # call signature -> LinearPlan
shape_plans = BoundedCache(1024)  # (m, k, n, dtypes, device, cfg, grads) -> LinearPlan


def eligible(x2d, weight, cfg, out_dtype):
    """True when a plan can serve this signature (see the module docstring); the per-call
    conditions (contiguity, alignment) are :func:`plan_for`'s."""
    return (type(x2d) is torch.Tensor and type(weight) in _WEIGHT_TYPES
            and traceable(x2d, weight, cfg, out_dtype))


def traceable(x2d, weight, cfg, out_dtype):
    """:func:`eligible` without the tensor types, for torch.compile's traced (fake) tensors:
    what the signature alone decides (the FSDP2 FP8 weight, which hands out its own FP8 data,
    excluded by its hook). The compiled ops (``compiled``) make the rest hold per call."""
    if not x2d.is_cuda or isinstance(cfg.weight, MXFP8) or x2d.dim() != 2 \
            or weight.dim() != 2 or hasattr(weight, "fp8blk_block_tensor"):
        return False
    (m, k), n = x2d.shape, weight.shape[0]
    return (weight.device == x2d.device and weight.shape[1] == k and m > 0 and k > 0
            and n > 0 and x2d.dtype in HIGH_DTYPES and weight.dtype in HIGH_DTYPES
            and out_dtype in HIGH_DTYPES)


def x_views(m, k, cfg, columnwise):
    """The quantize launcher's views of x (M, K)'s FP8 buffers as a plan's GEMMs take them:
    rowwise data (M, K) float8 row-major and its 1x128 scales (kt, M) as (M, kt); columnwise
    (when asked for, else None) x.T's (K, M) bytes as column-major (M, K) and its (mt,
    round4(K)) scales as they are."""
    fa = fp8_dtype(cfg.activation.fmt)
    k4 = round_up(k, 4)
    return [((m, k), (k, 1), fa), _scale_t(m, cdiv(k, 128))] + (
        [((m, k), (1, m), fa), ((cdiv(m, 128), k4), (k4, 1), torch.float32)] if columnwise
        else [None, None])


def _scale_t(rows, blocks):
    """An fp32 scale buffer (blocks, round4(rows)) -- fp8blk's layouts pad the fast dim to a
    multiple of 4 -- seen as (round4(rows), blocks) with strides (1, round4(rows))."""
    r4 = round_up(rows, 4)
    return ((r4, blocks), (1, r4), torch.float32)


def _general_mm(a, b, scale_a, scale_b, out=None, *, b_blocks, out_dtype):
    """A plan GEMM's operands (torch._scaled_mm's views of fp8blk's buffers) back as the
    buffers, through ``cuda_scaled_mm`` (torch._scaled_mm, on zero-padded copies where its
    kernel needs them): for the signatures cuBLASLt does not serve directly. With `out`, the
    product is copied into it (ScaledMM's contract)."""
    y = cuda_scaled_mm(a, scale_a.t(), b.t(), scale_b.t() if b_blocks == "128x128"
                       else scale_b, "1x128", b_blocks, out_dtype)
    return y if out is None else out.copy_(y)


class LinearPlan:
    """The launchers and GEMM operands of one signature. ``forward(x2d, weight)`` returns
    ``(y, saved)``; ``backward(dy2d, saved, weight, need_dgrad, need_wgrad)`` returns
    ``(dx, dw)`` (None where not needed; `dy2d` C-contiguous). `saved` is x's columnwise FP8
    data and scales.

    With ``keep_input`` the layer keeps x itself between the passes: the forward pass
    quantizes x rowwise only and returns ``(y, (None, None))``; the backward pass makes
    `saved` from x with ``columnwise(x2d)`` (the same bytes: one 128x1 block's quantization
    depends on that block's values alone).

    With ``cfg.low_memory_forward`` the forward pass runs in ``halves``: per half of the
    tokens (a multiple of 128 rows first), a rowwise-only quantize of those rows of x and
    the forward GEMM into those rows of y, each half's FP8 copy freed before the next is
    made; then, W's FP8 tiles freed, ``qxt`` makes x's columnwise copy alone (fp8blk/torch/config.py)."""

    __slots__ = ("qx", "qxt", "qw", "qwt", "qdy", "mm_fwd", "mm_dgrad", "mm_wgrad", "halves",
                 "y_spec", "keep_input", "lean")

    def __init__(self, x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad, keep_input=False):
        (m, k), n = x2d.shape, weight.shape[0]
        mt, kt, nt = cdiv(m, 128), cdiv(k, 128), cdiv(n, 128)
        fa, fw, fg = (fp8_dtype(cfg.activation.fmt), fp8_dtype(cfg.weight.fmt),
                      fp8_dtype(cfg.grad.fmt))
        w = weight.detach()
        # y = x @ W.T: a = x (M, K) row-major, its 1x128 scales (kt, M) as (M, kt); b = W's
        # (N, K) bytes as the column-major (K, N) torch takes, its tile scales (nt, kt) as
        # (kt, nt). wgrad's b is x's columnwise (K, M) bytes as column-major (M, K) with its
        # (mt, K) scales as they are.
        self.halves = None
        self.keep_input = keep_input
        # qxt: x's columnwise copy alone, made after the forward GEMMs (low_memory_forward) or
        # in the backward pass (keep_input); qx: x's rowwise copy, with the columnwise copy in
        # the same pass where neither applies
        self.qxt = quantize_launcher(x2d, cfg.activation, False, True, [None, None]
                                     + x_views(m, k, cfg, True)[2:]) if need_wgrad and (
            cfg.low_memory_forward or keep_input) else None
        self.qx = None if cfg.low_memory_forward else quantize_launcher(
            x2d, cfg.activation, True, need_wgrad and not keep_input,
            x_views(m, k, cfg, need_wgrad and not keep_input))
        self.qw = quantize_launcher(w, cfg.weight, True, False, [
            ((k, n), (1, k), fw), _scale_t(kt, nt), None, None])
        # dx = dY @ W: b is W's columnwise (K, N) bytes as column-major (N, K), its (kt, nt)
        # tile scales as (nt, kt). dY: a of dgrad (M, N) with (nt, M) scales as (M, nt); a of
        # wgrad its columnwise (N, M) bytes, (mt, N) scales as (N, mt).
        self.qwt = quantize_launcher(w, cfg.weight, False, True, [
            None, None, ((n, k), (1, n), fw), _scale_t(nt, kt)]) if need_dgrad else None
        self.qdy = None
        # each GEMM, mm(a, b, scale_a, scale_b): on cuBLASLt directly where that is on and
        # serves the signature (the same algorithm as torch._scaled_mm without its per-call
        # algorithm search), else cuda_scaled_mm (module docstring)
        dev = x2d.device

        def gemm(mm_m, mm_n, mm_k, a_dtype, b_dtype, b_blocks, dtype):
            return (_cublaslt.for_signature(mm_m, mm_n, mm_k, a_dtype, b_dtype, b_blocks,
                                            dtype, dev)
                    or functools.partial(_general_mm, b_blocks=b_blocks, out_dtype=dtype))

        self.mm_fwd = self.y_spec = None
        if not cfg.low_memory_forward:
            self.mm_fwd = gemm(m, n, k, fa, fw, "128x128", out_dtype)
        else:
            self.y_spec = ((m, n), (n, 1), out_dtype, dev)     # y's empty_strided args
            first = min(m, round_up(cdiv(m, 2), 128))
            self.halves = tuple(
                (r0, rows, r0 * k * x2d.element_size(),
                 quantize_launcher(x2d[r0:r0 + rows], cfg.activation, True, False, [
                     ((rows, k), (k, 1), fa), _scale_t(rows, kt), None, None]),
                 gemm(rows, n, k, fa, fw, "128x128", out_dtype))
                for r0, rows in ((0, first), (first, m - first)) if rows)
        self.mm_dgrad = gemm(m, k, n, fg, fw, "128x128", x2d.dtype) if need_dgrad else None
        self.mm_wgrad = gemm(n, k, m, fg, fa, "1x128", weight.dtype) if need_wgrad else None
        if need_dgrad or need_wgrad:
            dy = torch.empty((m, n), dtype=out_dtype, device=x2d.device)
            self.qdy = quantize_launcher(dy, cfg.grad, need_dgrad, need_wgrad, [
                ((m, n), (n, 1), fg) if need_dgrad else None,
                _scale_t(m, nt) if need_dgrad else None,
                ((n, m), (m, 1), fg) if need_wgrad else None,
                _scale_t(n, mt) if need_wgrad else None])
        self.lean = None
        if self.halves is None and all(isinstance(mm, _cublaslt.ScaledMM) or mm is None
                                       for mm in (self.mm_fwd, self.mm_dgrad, self.mm_wgrad)):
            self.lean = _Lean(self, x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad)

    def forward(self, x2d, weight, share=None):
        lean = self.lean
        if lean is not None:
            out = lean.forward(x2d, weight, share, lean.y)
            if out is not None:
                return out
        if self.halves is None:
            # share: the sharing scope's sharer of the layer's input (None: quantize here)
            xd, xs, xtd, xts = (self.qx(x2d, x2d.data_ptr()) if share is None
                                else share("plan", self.qx, x2d, x2d.data_ptr()))
            wd, ws = self.qw(weight, weight.data_ptr())[:2]
            return self.mm_fwd(xd, wd, xs, ws), (xtd, xts)
        shape, strides, dtype, dev = self.y_spec
        y = torch.empty_strided(shape, strides, dtype=dtype, device=dev)
        wd, ws = self.qw(weight, weight.data_ptr())[:2]
        ptr = x2d.data_ptr()
        for r0, rows, offset, qx, mm in self.halves:
            xd, xs = qx(x2d, ptr + offset)[:2]
            mm(xd, wd, xs, ws, y[r0:r0 + rows])
            xd = xs = None          # freed (stream-ordered) before the next half is made
        wd = ws = None
        if self.qxt is None or self.keep_input:
            return y, (None, None)
        return y, tuple(self.qxt(x2d, ptr)[2:])

    def columnwise(self, x2d):
        """x's columnwise FP8 data and scales, as the forward pass saves them
        (``keep_input`` plans: the backward pass's)."""
        return tuple(self.qxt(x2d, x2d.data_ptr())[2:])

    def backward(self, dy2d, xt_d, xt_s, weight, need_dgrad, need_wgrad, x2d=None):
        """(dx, dw) from dY; x's columnwise copy `xt_d`, `xt_s` as the forward pass saved it,
        or (``keep_input`` plans) made here from `x2d`."""
        if dy2d.data_ptr() & 15:             # contiguous already (the caller's)
            dy2d = dy2d.clone(memory_format=torch.contiguous_format)
        dx = dw = None
        if self.qdy is None:
            return dx, dw
        lean = self.lean
        if lean is not None:
            out = lean.backward(dy2d, xt_d, xt_s, weight, need_dgrad, need_wgrad, x2d, lean.dx)
            if out is not None:
                return out
        if x2d is not None and need_wgrad:
            xt_d, xt_s = self.columnwise(x2d)
        gd, gs, gtd, gts = self.qdy(dy2d, dy2d.data_ptr())
        if need_dgrad:
            wtd, wts = self.qwt(weight, weight.data_ptr())[2:]
            dx = self.mm_dgrad(gd, wtd, gs, wts)
        if need_wgrad:
            dw = self.mm_wgrad(gtd, xt_d, gts, xt_s)
        return dx, dw


class _Lean:
    """A plan's steps with every transient buffer in the default stream's scratch arena
    (fp8blk/torch/_arena.py: x's and W's rowwise FP8 copies, dY's copies, W's columnwise
    copy, a ``keep_input`` layer's columnwise copy of x, the cuBLASLt workspace) and the
    launches and GEMMs on raw addresses: each launch from a parameter block of its own
    (``LaunchSite``), the quantizes that meet in a pass in one launch
    (``quantize_group_site``: x and W forward unless a sharing scope makes x's copies; dY and
    W's columnwise copy backward, with a ``keep_input`` layer's columnwise copy of x), each
    GEMM on cuBLASLt descriptors of its own whose scale pointers stay set while the arena
    stays put. A step allocates only what outlives it (y, the saved
    columnwise copy of x, dx, dW) and makes no view: x and dY are read by address, so an
    N-D x needs no 2-D view and y and dx are allocated in the caller's shapes (``y_spec``,
    ``dx_spec``: shape, strides, dtype). The same kernels and GEMMs on the same bytes as the
    plan's other path, which serves what this one does not (``forward`` and ``backward``
    return None there): streams other than the device's default (CUDA-graph capture and
    inductor's CUDA-graph warm-up among them: their allocations belong to the graph's pool),
    a current device other than the plan's, GEMMs on ``torch._scaled_mm`` and
    ``low_memory_forward``. With a sharing scope the input's FP8 copies are the scope's
    (allocated: other layers read them later)."""

    __slots__ = ("index", "device", "qx", "sw", "sdy", "sxt", "sxw", "sdyw", "sdywx",
                 "mm_fwd", "mm_dgrad", "mm_wgrad", "y", "dx", "dw", "xt", "cols", "dy_dirs",
                 "fwd", "bwd", "need_fwd", "need_bwd", "raw_stream", "default_stream", "at",
                 "fwd_lock", "bwd_lock")

    def __init__(self, plan, x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad):
        (m, k), n = x2d.shape, weight.shape[0]
        self.index, self.device = x2d.get_device(), x2d.device
        self.qx = plan.qx
        # single launches: W where a sharing scope makes x's copies (and the compiled
        # layer's forward_mm), dY without dgrad, x's columnwise copy without dgrad
        self.sw = plan.qw.site()
        self.sdy, self.sxt = (None if q is None else q.site() for q in (plan.qdy, plan.qxt))
        # the same kernels' work in one launch each (the same bytes: a block's quantization
        # reads that block alone), slots [x, 4 buffers] per launcher in turn: x and W
        # forward; dY and W's columnwise copy, and x's columnwise copy after them where the
        # backward pass makes it (keep_input)
        self.sxw = quantize_group_site([plan.qx, plan.qw])
        self.sdyw = self.sdywx = None
        if plan.qwt is not None and plan.qdy is not None:
            self.sdyw = quantize_group_site([plan.qdy, plan.qwt])
            if plan.qxt is not None:
                self.sdywx = quantize_group_site([plan.qdy, plan.qwt, plan.qxt])
        self.mm_fwd, self.mm_dgrad, self.mm_wgrad = (
            None if mm is None else mm.own() for mm in (plan.mm_fwd, plan.mm_dgrad,
                                                        plan.mm_wgrad))
        self.y = ((m, n), (n, 1), out_dtype)
        self.dx = ((m, k), (k, 1), x2d.dtype)
        self.dw = ((n, k), (k, 1), weight.dtype)
        self.xt = tuple(x_views(m, k, cfg, True)[2:])      # the saved columnwise copy of x
        self.cols = need_wgrad and not plan.keep_input
        self.dy_dirs = (need_dgrad, need_wgrad)
        zeros = [0, 0, 0, 0]
        qx, qw = plan.qx.nbytes, plan.qw.nbytes
        dy = plan.qdy.nbytes if plan.qdy is not None else zeros
        wt = plan.qwt.nbytes if plan.qwt is not None else zeros
        xt = plan.qxt.nbytes if plan.qxt is not None else zeros
        # each pass carves its arena from offset 0: a call's buffers are dead once it has
        # queued its GEMMs (the passes run on different threads' arenas where autograd's
        # device thread runs the backward pass)
        self.fwd, self.need_fwd = _arena.carve([qx[0], qx[1], qw[0], qw[1],
                                                _workspace(self.mm_fwd)])
        self.bwd, self.need_bwd = _arena.carve(dy + [wt[2], wt[3], xt[2], xt[3], max(
            _workspace(self.mm_dgrad), _workspace(self.mm_wgrad))])
        # (arena base, the buffers' addresses) last used by each pass: [forward, backward]
        self.at = [(None, ()), (None, ())]
        # the sites' slots are shared: one call of a pass at a time (threads may share a layer)
        self.fwd_lock, self.bwd_lock = threading.Lock(), threading.Lock()
        self.raw_stream = _arrays.torch_raw_stream()
        self.default_stream = torch.cuda.default_stream(self.device).cuda_stream

    def stream(self):
        """The device's default stream (a raw handle) where this path serves the call: it is
        current, on the plan's device, and not capturing; else None. Other streams take the
        allocating path: inductor's CUDA-graph trees warm up on a stream of their own with
        every allocation of the thread going to the graph's pool (no capture to detect), so
        scratch memory made there would be a live untracked tensor in that pool."""
        index = self.index
        if _current_device() != index or self.raw_stream(index) != self.default_stream \
                or _capturing():
            return None
        return self.default_stream

    def forward(self, x, weight, share, y_spec):
        """``(y, saved)`` of x (any shape, C-contiguous, the plan's (M, K) elements) and W,
        y allocated as `y_spec`; None where this path does not serve the call."""
        stream = self.stream()
        if stream is None:
            return None
        xd, xs, wd, ws, work = self._buffers(stream, False)
        empty, dev = torch.empty_strided, self.device
        y = empty(y_spec[0], y_spec[1], dtype=y_spec[2], device=dev)
        ptr = x.data_ptr()
        with self.fwd_lock:
            if share is not None:   # the scope's copies: allocated, other layers read them
                bufs = share("plan", self.qx, x, ptr)
                xd, xs, saved = bufs[0].data_ptr(), bufs[1].data_ptr(), (bufs[2], bufs[3])
                self._weight_mm(weight, xd, xs, wd, ws, work, y, stream)
                return y, saved
            site = self.sxw         # x's copies and W's rowwise copy in one launch
            a = site.args
            a[0], a[1], a[2] = ptr, xd, xs
            if self.cols:
                (s_d, st_d, t_d), (s_s, st_s, t_s) = self.xt
                saved = (empty(s_d, st_d, dtype=t_d, device=dev),
                         empty(s_s, st_s, dtype=t_s, device=dev))
                a[3], a[4] = saved[0].data_ptr(), saved[1].data_ptr()
            else:
                saved = (None, None)
                a[3] = a[4] = ptr
            a[5] = a[8] = a[9] = weight.data_ptr()
            a[6], a[7] = wd, ws
            site.launch(stream)
            self.mm_fwd.run(xd, wd, xs, ws, y.data_ptr(), work, stream)
        return y, saved

    def forward_mm(self, xd, xs, weight):
        """y (M, N) from x's rowwise FP8 buffers `xd`, `xs` (the plan's views: the compiled
        layer's first op made them) and W: W's rowwise copy and the GEMM's workspace in the
        arena; None where this path does not serve the call."""
        stream = self.stream()
        if stream is None:
            return None
        wd, ws, work = self._buffers(stream, False)[2:]
        shape, strides, dtype = self.y
        y = torch.empty_strided(shape, strides, dtype=dtype, device=self.device)
        with self.fwd_lock:
            self._weight_mm(weight, xd.data_ptr(), xs.data_ptr(), wd, ws, work, y, stream)
        return y

    def _buffers(self, stream, backward):
        """A pass's transients as addresses in this thread's arena for `stream`: the forward
        pass's (x's rowwise data and scales, W's, the workspace) or the backward pass's (dY's
        four buffers, W's columnwise data and scales, x's, the workspace). The addresses are
        worked out again only when the arena moved."""
        need, offsets = (self.need_bwd, self.bwd) if backward else (self.need_fwd, self.fwd)
        base = _arena.reserve(self.index, stream, need, self.device)
        at = self.at[backward]
        if at[0] != base:
            at = self.at[backward] = (base, tuple(base + o for o in offsets))
        return at[1]

    def _weight_mm(self, weight, xd, xs, wd, ws, work, y, stream):
        site = self.sw
        a = site.args
        a[0] = a[3] = a[4] = weight.data_ptr()
        a[1], a[2] = wd, ws
        site.launch(stream)
        self.mm_fwd.run(xd, wd, xs, ws, y.data_ptr(), work, stream)

    def backward(self, dy, xt_d, xt_s, weight, need_dgrad, need_wgrad, x, dx_spec):
        """``(dx, dw)`` from dY (any shape, C-contiguous, 16-byte aligned, (M, N) elements),
        dx allocated as `dx_spec`; x's columnwise copy `xt_d`, `xt_s` as the forward pass
        saved it, or (``keep_input`` plans) made here from `x`; None where this path does not
        serve the call."""
        stream = self.stream()
        if stream is None:
            return None
        gd, gs, gtd, gts, wtd, wts, xtd, xts, work = self._buffers(stream, True)
        rows, cols = self.dy_dirs
        empty, dev = torch.empty_strided, self.device
        dx = dw = None
        make_xt = need_wgrad and x is not None  # keep_input: x's columnwise copy, transient
        with self.bwd_lock:
            # dY's copies, with W's columnwise copy (dgrad) and x's (keep_input) in the same
            # launch: slots [dY, its 4 buffers, W, its 4, x, its 4]
            site = self.sdy
            if need_dgrad:
                site = self.sdywx if make_xt and self.sdywx is not None else self.sdyw
            a = site.args
            ptr = a[0] = dy.data_ptr()
            a[1], a[2] = (gd, gs) if rows else (ptr, ptr)
            a[3], a[4] = (gtd, gts) if cols else (ptr, ptr)
            if need_dgrad:
                a[5] = a[6] = a[7] = weight.data_ptr()
                a[8], a[9] = wtd, wts
                if site is self.sdywx:
                    a[10] = a[11] = a[12] = x.data_ptr()
                    a[13], a[14] = xtd, xts
                    make_xt = False
            site.launch(stream)
            if need_dgrad:
                dx = empty(dx_spec[0], dx_spec[1], dtype=dx_spec[2], device=dev)
                self.mm_dgrad.run(gd, wtd, gs, wts, dx.data_ptr(), work, stream)
            if need_wgrad:
                if make_xt:
                    site = self.sxt
                    a = site.args
                    a[0] = a[1] = a[2] = x.data_ptr()
                    a[3], a[4] = xtd, xts
                    site.launch(stream)
                elif x is None:
                    xtd, xts = xt_d.data_ptr(), xt_s.data_ptr()
                shape, strides, dtype = self.dw
                dw = empty(shape, strides, dtype=dtype, device=dev)
                self.mm_wgrad.run(gtd, xtd, gts, xts, dw.data_ptr(), work, stream)
        return dx, dw


def _workspace(mm):
    return 0 if mm is None else mm.ws_size


# torch's C functions behind torch.cuda.current_device() / is_current_stream_capturing()
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def plan_for(x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad, keep_input=False):
    """The plan of this forward call's signature (made on first use), or None when a plan
    cannot serve it. `x2d` must be C-contiguous (the caller makes it so); `need_dgrad`,
    `need_wgrad`: whether x and the weight need gradients; `keep_input`: see
    :class:`LinearPlan`."""
    if weight.data_ptr() & 15 or x2d.data_ptr() & 15 or not weight.is_contiguous():
        return None
    k = (x2d.shape, x2d.dtype, weight.shape, weight.dtype, type(weight), type(x2d),
         x2d.get_device(), weight.get_device(), cfg, out_dtype, need_dgrad, need_wgrad,
         keep_input)
    plan = plans.get(k)
    if plan is None:
        if not eligible(x2d, weight, cfg, out_dtype):
            return None
        _check_not_capturing(x2d.shape, weight.shape)
        plan = plans.put(k, LinearPlan(x2d, weight, cfg, out_dtype, need_dgrad, need_wgrad,
                                       keep_input))
    return plan


def _check_not_capturing(x_shape, w_shape):
    """A plan is made with driver work (kernel loads, cuBLASLt descriptors and algorithm
    choice, buffers) that a CUDA-graph capture must not record: its first call belongs
    before the capture, as torch's warm-up iterations do."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"Float8BlockLinear: the first call of input {tuple(x_shape)} with weight "
            f"{tuple(w_shape)} happens during CUDA-graph capture; warm the layer up before "
            f"capture (run its forward and backward pass at this shape once outside the "
            f"capture, as torch.cuda.graph's warm-up on a side stream does)")


def plan_for_shapes(m, k, n, x_dtype, w_dtype, device, cfg, out_dtype, need_dgrad, need_wgrad,
                    keep_input=False):
    """The plan of x (m, k) `x_dtype` @ W (n, k) `w_dtype` on CUDA `device`, for callers that
    hold no x (the compiled ops' backward), made on first use from stand-in tensors. Its
    launchers were chosen for 16-byte aligned, C-contiguous operands: the caller passes such."""
    key = (m, k, n, x_dtype, w_dtype, device, cfg, out_dtype, need_dgrad, need_wgrad, keep_input)
    plan = shape_plans.get(key)
    if plan is None:
        _check_not_capturing((m, k), (n, k))
        x2d = torch.empty((m, k), dtype=x_dtype, device=device)
        weight = torch.empty((n, k), dtype=w_dtype, device=device)
        plan = shape_plans.put(key, LinearPlan(x2d, weight, cfg, out_dtype, need_dgrad,
                                               need_wgrad, keep_input))
    return plan
