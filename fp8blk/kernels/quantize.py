"""GPU ``quantize``: the launcher of ``_quantize_kernel`` (one tiled kernel, one pass over the
input for any combination of rowwise and columnwise outputs into the docs/layouts.md buffers),
with the launch plans, the repeated-call launchers of the hot path, and :func:`use_settings`.
Same contract as ``fp8blk.reference.quantize`` plus ``dtype``, the logical input dtype.
"""
from __future__ import annotations

import numpy as np

from .. import scaling
from .._arrays import BF16, numpy_to_torch_dtype
from ..formats import E4M3, MXFP8, check_mxfp8_shape, recipe_kind
from ..layout import buffer_layouts, cdiv, round_up
from . import _cache
from . import _specs as sp
from ._launch import (LaunchSite, Tuning, adapter_of, cached_plan, contiguous_strides, kind_of,
                      launch_here, plan_cache, scalars, torch_launch)
from ._specs import SIM

_VMAX = {sp.F32: scaling.FLT_MAX, sp.BF16: scaling.dtype_max(BF16),
         sp.F16: scaling.dtype_max(np.float16)}

# (recipe, kind, rowwise, columnwise, vec, col_vec, device) -> (kernel, spec): the per-call
# lookup (one entry per kernel variant in use: few)
_kernels = {}
_plans = plan_cache()  # call signature -> _Plan
# The public ``fb.quantize`` validates a call once per (array type, recipe, dtype, shape,
# directions, alignment, device) and keeps a launcher for it here; a later call with the same
# key skips the checks, the plan lookup and the adapters: on the GPU its host time is the
# allocations and the launch.
repeat_calls = plan_cache()
# (part specs, device) -> (group kernel, QuantizeGroupSpec): the kernels of :func:`group_site`
# and :func:`quantize_group`
_groups = {}
_tuning = Tuning(sp.QuantizeSettings(), (_kernels, _plans, repeat_calls, _groups))
use_settings = _tuning.use  # (a backend.QuantizeSettings) -> the previous settings


def loaded_kernels():
    """[(launchable kernel, ``QuantizeSpec``)] of the quantize variants this process has
    looked up since the last ``use_settings`` (benchmarks read their register counts)."""
    return list(_kernels.values())


def spec_for(recipe, kind, rowwise, columnwise, vec, col_vec, settings=None):
    """The ``_specs.QuantizeSpec`` of a call: `recipe` a Block1D / Block2D / MXFP8 recipe,
    `kind` the input kind (``_specs.F32`` / ``BF16`` / ``F16``), `vec` K % VE == 0 with an
    aligned input, `col_vec` M % 16 == 0; `settings` default: the current ones."""
    is_mx = isinstance(recipe, MXFP8)
    return sp.quantize_spec(
        recipe_kind(recipe), kind, recipe.fmt is E4M3, rowwise, columnwise,
        pow2=False if is_mx else recipe.pow2_scales,
        eps=0.0 if is_mx else recipe.amax_epsilon, vmax=_VMAX[kind], vec=vec, col_vec=col_vec,
        settings=_tuning.settings if settings is None else settings)


def _kernel_for(recipe, kind, rowwise, columnwise, vec, col_vec, device):
    key = (recipe, kind, rowwise, columnwise, vec, col_vec, device)
    hit = _kernels.get(key)
    if hit is None:
        spec = spec_for(recipe, kind, rowwise, columnwise, vec, col_vec)
        hit = (_cache.kernel("quantize", spec, device), spec)
        _kernels[key] = hit
    return hit


class _Plan:
    """Everything about a quantize call that depends only on (recipe, input kind, shape,
    directions, alignment): the kernel, its launch shape, the output layouts and the offsets
    of the outputs inside one allocation. Built once per key, so a call does one dict lookup,
    one allocation and one launch."""

    __slots__ = ("kernel", "spec", "grid", "block", "shapes", "offsets", "nbytes", "scalars",
                 "arg_dtypes")

    def __init__(self, recipe, kind, rows, cols, rowwise, columnwise, vec, device):
        self.kernel, spec = _kernel_for(recipe, kind, rowwise, columnwise, vec, rows % 16 == 0,
                                        device)
        self.spec = spec
        tm, tk = sp.quantize_tile(spec)
        self.grid = (cdiv(rows, tm), cdiv(cols, tk), 1)
        self.block = (spec.threads, 1, 1)
        self.shapes = [None if s is None else (s.shape, s.dtype)
                       for s in buffer_layouts(recipe, rows, cols, rowwise, columnwise)]
        # each output starts on a 256-byte boundary (the kernels' vector stores need 16)
        self.offsets, total = [], 0
        for s in self.shapes:
            self.offsets.append(None if s is None else total)
            if s is not None:
                total += round_up(int(np.prod(s[0])) * np.dtype(s[1]).itemsize, 256)
        self.nbytes = total
        self.scalars = scalars(rows, cols)
        # element types of the five pointer arguments (the simulator's views need them)
        self.arg_dtypes = _cache.arg_dtypes("quantize", spec, 5) if SIM else (None,) * 5



def _check_out(ad, out, shapes):
    out = tuple(out)
    for buf, want in zip(out, shapes):
        if want is None:
            continue
        if buf is None or tuple(buf.shape) != want[0] or ad.dtype(buf) != want[1] \
                or not ad.contiguous(buf) or ad.ptr(buf) % 16:
            raise ValueError(f"quantize out= buffer must be a C-contiguous, 16-byte aligned "
                             f"{want[1]} array of shape {want[0]}, got "
                             f"{None if buf is None else (buf.dtype, tuple(buf.shape))}")
    return out


def _plan_for(recipe, kind, rows, cols, rowwise, columnwise, vec, device):
    """The cached :class:`_Plan` of a call; `device` the CUDA device index of the arrays (the
    compiled kernel belongs to it; None under the simulator)."""
    return cached_plan(_plans, (recipe, kind, rows, cols, rowwise, columnwise, vec, device),
                       _Plan)


def _call_plan(ad, x2d, recipe, rowwise, columnwise, kind):
    """``(plan, data pointer)`` of a quantize of the non-empty 2-D array `x2d` (adapter `ad`,
    input kind `kind`): the vector path when K fills whole chunks and x is 16-byte aligned."""
    ptr = ad.ptr(x2d)
    rows, cols = x2d.shape
    vec = cols % sp.ELEMS_PER_CHUNK[kind] == 0 and ptr % 16 == 0
    return _plan_for(recipe, kind, rows, cols, rowwise, columnwise, vec, ad.device_index(x2d)), ptr


def quantize(x2d, recipe, rowwise=True, columnwise=False, dtype=None, out=None):
    """Quantize a C-contiguous 2-D (M, K) device array: a CuPy array (float32, float16, or bf16
    held as uint16 with ``dtype`` = bfloat16) or a torch CUDA tensor (outputs are then torch
    tensors and the kernel runs on torch's current stream). Returns ``(row_data, row_sinv,
    col_data, col_sinv)`` (None for a direction not asked for) in docs/layouts.md layouts,
    without synchronizing.

    The outputs are views of one allocation (each 256-byte aligned): it is freed when the last
    of them is. ``out``: None, or four arrays (None for a direction not asked for) of exactly
    the layouts above, C-contiguous and 16-byte aligned, written in place instead."""
    ad = adapter_of(x2d)
    plan, out = _prepared(ad, x2d, recipe, rowwise, columnwise, dtype, out)
    if plan is not None:
        _launch_one(ad, plan, x2d, out)
    return out


def _launch_one(ad, plan, x2d, out):
    # unused outputs get any valid pointer (the input's)
    args = ad.args((x2d,) + tuple(out), plan.arg_dtypes, plan.scalars)
    ad.launch(plan.kernel, plan.grid, plan.block, args, x2d)


def _prepared(ad, x2d, recipe, rowwise, columnwise, dtype, out=None):
    """``(plan, outputs)`` of a quantize of `x2d` (adapter `ad`), checked and allocated (or
    `out` checked) but not launched; plan None for an empty array, whose outputs are then
    its empty buffers (every scale tensor is empty too: docs/layouts.md shapes)."""
    kind = kind_of(ad.dtype(x2d), dtype)
    rows, cols = x2d.shape
    check_mxfp8_shape(recipe, rows, cols, "x2d")
    if rows == 0 or cols == 0:
        return None, tuple(None if s is None else ad.empty(s.shape, s.dtype, x2d)
                           for s in buffer_layouts(recipe, rows, cols, rowwise, columnwise))
    plan = _call_plan(ad, x2d, recipe, rowwise, columnwise, kind)[0]
    if out is None:
        return plan, ad.alloc(x2d, plan.nbytes, plan.shapes, plan.offsets)
    return plan, _check_out(ad, out, plan.shapes)


# -- groups: 2 or 3 quantizes in one launch (``_quantize_kernel.make_group_kernel_pyfunc``) ----


def _group_kernel(specs, device):
    """(launchable group kernel, its ``QuantizeGroupSpec``) of the quantize variants `specs`
    on CUDA device `device` (None under the simulator)."""
    key = (tuple(specs), device)
    hit = _groups.get(key)
    if hit is None:
        gspec = sp.quantize_group_spec(specs)
        hit = _groups[key] = (_cache.kernel("quantize_group", gspec, device), gspec)
    return hit


def _group_shape(kernel_spec, plans):
    """(grid, block) of a group launch of `plans` (launch plans or launchers with ``grid``):
    each part's single-kernel CTAs on one 1-D grid, the group's CTA size."""
    return ((sum(p.grid[0] * p.grid[1] for p in plans), 1, 1),
            (kernel_spec.parts[0].threads, 1, 1))


def quantize_group(parts):
    """Quantize 2 or 3 C-contiguous 2-D device arrays of one family and device in one kernel
    launch: `parts` holds ``(x2d, recipe, rowwise, columnwise, dtype)`` per array, as
    :func:`quantize` takes them. Returns one ``(row_data, row_sinv, col_data, col_sinv)`` per
    part: the bytes :func:`quantize` gives for it (a block's bytes and scale depend on that
    block's values alone, and the scale padding on the shape alone, so which CTA of which
    launch does the work changes nothing). A part with no elements takes no CTA; with one
    part left it runs alone."""
    ad = adapter_of(parts[0][0])
    results, launched = [], []
    for x2d, recipe, rowwise, columnwise, dtype in parts:
        if adapter_of(x2d) is not ad:
            raise TypeError("quantize_group: the arrays must be of one family")
        plan, out = _prepared(ad, x2d, recipe, rowwise, columnwise, dtype)
        results.append(out)
        if plan is not None:
            launched.append((plan, x2d, out))
    if len({ad.device_index(x) for _, x, _ in launched}) > 1:
        raise ValueError("quantize_group: the arrays must be on one device")
    if len(launched) == 1:
        _launch_one(ad, *launched[0])
    elif launched:
        plans = [p for p, _, _ in launched]
        like = launched[0][1]
        kernel, gspec = _group_kernel([p.spec for p in plans], ad.device_index(like))
        grid, block = _group_shape(gspec, plans)
        # pointers part after part, then the scalars (``group_argtypes``); an output a part
        # does not write gets any valid pointer
        arrays = [a for _, x, out in launched for a in (x,) + tuple(out)]
        args = ad.args(arrays, [t for p in plans for t in p.arg_dtypes],
                       tuple(v for p in plans for v in p.scalars))
        ad.launch(kernel, grid, block, args, like)
    return results


def group_site(calls):
    """A :class:`~fp8blk.kernels._launch.LaunchSite` of one launch doing the work of the
    launchers `calls` (2 or 3 :class:`_TorchCall` of one device, from :func:`torch_call`):
    its ``args`` slots are each call's ``[x, out0, out1, out2, out3]`` in turn (5 per call,
    as :meth:`_TorchCall.site` has them), then the scalars, which are set. The buffers it
    writes are byte for byte the calls' own (:func:`quantize_group`)."""
    index = calls[0].index
    if any(c.index != index for c in calls):
        raise ValueError("group_site: the launchers must be of one device")
    kernel, gspec = _group_kernel([c.spec for c in calls], index)
    grid, block = _group_shape(gspec, calls)
    return LaunchSite(kernel, grid, block,
                      [0] * (5 * len(calls)) + [v for c in calls for v in c.scalars], index)


# -- repeated calls (:data:`repeat_calls`) ----------------------------------------------------


class _TorchCall:
    """``call(x, ptr)``: the call's four buffers for a torch CUDA tensor `x` (data pointer
    `ptr`) of the recorded dtype, shape, alignment and device: one torch tensor per buffer
    from the caching allocator, the kernel launched on torch's current stream. ``shape``
    and ``dtype`` are the logical shape (a tuple) and dtype the BlockTensor records."""

    __slots__ = ("kernel", "spec", "grid", "block", "outs", "scalars", "index", "device",
                 "shape", "dtype", "empty")

    def __init__(self, plan, x, dtype, views=None):
        import torch

        self.kernel, self.spec, self.grid, self.block = (plan.kernel, plan.spec, plan.grid,
                                                         plan.block)
        self.outs = [None if s is None else (s[0], contiguous_strides(s[0]),
                                             numpy_to_torch_dtype(np.dtype(s[1])))
                     for s in plan.shapes]
        if views is not None:
            self.outs = _checked_views(self.outs, views)
        self.scalars = [int(v) for v in plan.scalars]
        self.index, self.device = x.get_device(), x.device
        self.shape, self.dtype = tuple(x.shape), dtype
        self.empty = torch.empty_strided

    def __call__(self, x, ptr):
        # torch.empty_strided is the cheapest of torch's allocating calls from Python (cheaper
        # than x.new_empty and torch.empty(shape, dtype=, device=))
        empty, device = self.empty, self.device
        outs = [None if o is None else empty(o[0], o[1], dtype=o[2], device=device)
                for o in self.outs]
        # unused outputs get any valid pointer (the input's)
        args = [ptr] + [ptr if o is None else o.data_ptr() for o in outs] + self.scalars
        torch_launch(self.kernel, self.grid, self.block, args, self.index)
        return outs

    def arguments(self, x, outs):
        """The kernel's argument list for input address `x` and the four buffers' addresses
        `outs` (None for a direction not asked for), each :attr:`nbytes` long: for a caller
        that places the buffers itself and launches with :meth:`launch`."""
        return [x] + [x if o is None else o for o in outs] + self.scalars

    def launch(self, args, stream):
        """Launch with :meth:`arguments`' list on raw stream `stream`; the current device
        must be the recorded one."""
        launch_here(self.kernel, self.grid, self.block, args, stream, self.index)

    def site(self):
        """A :class:`~fp8blk.kernels._launch.LaunchSite` of this call's kernel: its ``args``
        slots are ``[x, out0, out1, out2, out3]`` (input and the four buffers' addresses; a
        direction not asked for takes any valid pointer, e.g. x's) then the scalars, which
        are set; the current device must be the recorded one when it launches."""
        return LaunchSite(self.kernel, self.grid, self.block, [0] * 5 + self.scalars,
                          self.index)

    @property
    def nbytes(self):
        """The byte size of each of the four buffers (0 for a direction not asked for)."""
        return [0 if o is None else int(np.prod(o[0])) * o[2].itemsize for o in self.outs]


class _CupyCall:
    """``call(x, ptr)``: the call's four buffers for a CuPy array `x` of the recorded dtype,
    shape, alignment and device: views of one memory-pool allocation, the kernel launched
    through its CuPy Function on CuPy's current stream."""

    __slots__ = ("kernel", "grid", "block", "layouts", "offsets", "nbytes", "scalars",
                 "shape", "dtype", "index", "alloc", "ndarray")

    def __init__(self, plan, x, dtype):
        import cupy

        self.alloc, self.ndarray = cupy.cuda.alloc, cupy.ndarray
        self.kernel, self.grid, self.block = plan.kernel, plan.grid, plan.block
        self.layouts, self.offsets, self.nbytes = plan.shapes, plan.offsets, plan.nbytes
        self.scalars = plan.scalars
        self.shape, self.dtype, self.index = tuple(x.shape), dtype, x.data.device_id

    def __call__(self, x, ptr):
        mem = self.alloc(self.nbytes)
        ndarray = self.ndarray
        outs = [None if s is None else ndarray(s[0], s[1], memptr=mem + o if o else mem)
                for s, o in zip(self.layouts, self.offsets)]
        self.kernel(self.grid, self.block,
                    tuple([x if o is None else o for o in [x] + outs]) + self.scalars)
        return outs


def _checked_views(outs, views):
    """`views` (per output None or (shape, strides, torch dtype)) after checking that each
    covers exactly the bytes of its buffer's layout: the same byte count, dense (its strides
    a permutation of contiguous strides of its shape), a direction held iff its layout is."""
    checked = []
    for out, view in zip(outs, views):
        if (out is None) != (view is None):
            raise ValueError("torch_call: a view per buffer held, None for one not held")
        if view is None:
            checked.append(None)
            continue
        shape, strides, dtype = tuple(view[0]), tuple(view[1]), view[2]
        order = sorted(range(len(shape)), key=lambda i: strides[i])
        dense = contiguous_strides(tuple(shape[i] for i in reversed(order)))[::-1]
        if int(np.prod(shape)) * dtype.itemsize != int(np.prod(out[0])) * out[2].itemsize \
                or tuple(strides[i] for i in order) != tuple(dense):
            raise ValueError(f"torch_call: view {view} does not cover the {out[2]} buffer "
                             f"{out[0]} exactly")
        checked.append((shape, strides, dtype))
    return checked


def torch_call(x, recipe, rowwise, columnwise, dtype, views):
    """A launcher like the hot path's, ``call(x, ptr) -> [4 tensors]``, for torch CUDA tensors
    of `x`'s dtype, 2-D shape, 16-byte alignment and device (`x` validated by the caller; the
    caller checks those per call): each output is allocated as ``views[i] = (shape, strides,
    torch dtype)``, the same bytes as its docs/layouts.md buffer seen as the consumer wants
    them (e.g. FP8 data as ``torch.float8_e4m3fn``, a scale buffer transposed), so a consumer
    such as ``torch._scaled_mm`` takes them without view calls. ``views[i]`` is None for a
    direction not asked for."""
    ad = adapter_of(x)
    plan = _call_plan(ad, x, recipe, rowwise, columnwise, kind_of(ad.dtype(x), dtype))[0]
    return _TorchCall(plan, x, dtype, views)


def record_call(x, x2d, recipe, rowwise, columnwise, dtype):
    """Keep a launcher for a validated, non-empty quantize of `x` (a torch CUDA tensor or a
    CuPy array; `x2d` its (M, K) view, `dtype` the logical dtype) in :data:`repeat_calls`
    under ``(type, recipe, x.dtype, x.shape, rowwise, columnwise, 16-byte aligned, device
    index)``:
    the key the public function's hot path looks up."""
    if SIM:
        return
    ad = adapter_of(x2d)
    plan, ptr = _call_plan(ad, x2d, recipe, rowwise, columnwise, kind_of(ad.dtype(x2d), dtype))
    call = (_CupyCall if ad.name == "cupy" else _TorchCall)(plan, x, dtype)
    repeat_calls.put((type(x), recipe, x.dtype, x.shape, rowwise, columnwise, not ptr & 15,
                      call.index), call)
