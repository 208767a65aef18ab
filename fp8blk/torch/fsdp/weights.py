"""FSDP2 weight tensors that all-gather FP8 bytes (docs/distributed.md and docs/torch.md).

Three ``torch.Tensor`` wrapper subclasses; each claims the weight's high-precision dtype (so
autograd treats it as a float parameter), holds its real storage in inner tensors, and shares
one :class:`WeightState` (recipe, global shape, the global block scales, statistics) with every
tensor FSDP derives from it (chunks, pads, views):

``Float8BlockPrimaryWeight`` (mode "primary", FP8 primary weights; FSDP's sharded local tensor)
    inner "planes": the rowwise FP8 bytes of the rows this rank holds, uint8, shaped exactly
    like the tensor (for MXFP8 also the columnwise bytes, (M, K)-shaped too), so every view,
    chunk, pad and copy FSDP applies maps 1:1 onto the planes. The bytes are written by
    :func:`fp8blk.torch.cast_master_weights_` from fp32 master shards; the optimizer never
    touches them.
``Float8BlockCastWeight`` (mode "cast", high-precision parameters, FP8 on the wire)
    wraps the bf16/fp32 parameter (one plane); the optimizer updates it in place. The FP8
    bytes of the local rows are cast once per step, for all weights together, by
    :func:`fp8blk.torch.precompute_fp8_scales` (or lazily at the first gather after the
    parameters changed), with scales from one packed partial-amax all-reduce.
``Float8BlockWeight`` (both modes; FSDP's unsharded parameter)
    the gathered weight: a :class:`fp8blk.BlockTensor` of the full (M, K) weight whose
    rowwise bytes are the all-gather output (no copy) and whose scales are the replicated
    global scales; ``fp8blk_block_tensor(rowwise, columnwise)`` hands it to the Linear.

Only FP8 bytes travel through FSDP's all-gather, as uint8 (gloo cannot gather float8): for
Block2D the rowwise plane always (the columnwise copy is its FP8 transpose, made locally when
the pass needs it); for MXFP8 the plane(s) the pass needs. The scales never travel: every
rank computed the same global scales (partial amax over its shard, one MAX all-reduce), so
shard boundaries may cut tiles anywhere and the gathered weight equals
``fb.quantize(bf16(full weight))`` byte for byte.
"""
from __future__ import annotations

import collections
import copy
import inspect
import weakref

import torch
from torch.utils._pytree import tree_map_only

from ... import _arrays
from ...formats import Block2D, MXFP8
from ...layout import all_layouts, cdiv
from ...tensor import BlockTensor, from_internal, internal_buffers
from .state import fsdp_param_of, state_name, usage_for

aten = torch.ops.aten

# Ops that only reshape, view, copy or allocate: applied to every plane with the same
# arguments (the planes have the tensor's shape), the result wrapped again. These are all
# that FSDP2 applies to a parameter when sharding, padding and re-padding it.
_PLANE_OPS = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.empty_like.default, aten.zeros_like.default, aten.clone.default,
    aten._to_copy.default, aten._pin_memory.default, aten.copy_.default,
}
_NEW_OPS = {aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
            aten.empty_like.default, aten.zeros_like.default, aten._to_copy.default}


# --------------------------------------------------------------------------------------------
# Shared per-weight state


class WeightState:
    """What every tensor derived from one weight shares.

    ``recipe`` (Block2D or MXFP8), ``shape`` (M, K) of the unsharded weight, ``dtype`` the
    nominal torch dtype, ``model_dtype`` the dtype the FP8 bytes are quantized from (bf16:
    bytes equal ``quantize(bf16(w))``), ``mode`` "primary" or "cast", ``scales`` the global
    scale_inv tensors [rowwise, columnwise or None] (torch, persistent), ``scale_tensor`` a
    BlockTensor holding only those scales (the master cast writes them in place).

    ``gathers`` logs every pre-all-gather as a dict (training state, usage, planes, bytes
    sent by this rank, world size), for tests and the benchmark; ``log_gathers`` turns it off.
    """

    def __init__(self, recipe, shape, dtype, model_dtype, mode, device):
        self.recipe = recipe
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.model_dtype = model_dtype
        self.mode = mode
        self._alloc_scales(device)
        self.registry = None      # the Registry of the model this weight was converted in
        self.fsdp = None          # (FSDPParam, FSDPParamGroup) once looked up
        self.hook_module = None   # the module the pre-all-gather hook found self.fsdp for
        self.mesh_place = None    # (mesh, outer_size, world, rank, chunk rows, cols) of it
        self.cast_items = {}      # batch.py: the master cast's Item per weight, while valid
        self.shard_place = None   # (first flat index, element count) of this rank's shard
        self.frags = None         # mode "cast": padded local FP8 bytes per plane (torch uint8)
        self.cast_version = None  # mode "cast": (parameter version, writes) the bytes come from
        self.writes = 0           # mode "cast": copies of plain tensors into a shard of it
        self.gathers = collections.deque(maxlen=64)  # the latest pre-all-gathers
        self.log_gathers = True

        # per usage (rowwise, columnwise): the planes the all-gather sends, and their index
        # among the planes a rank holds
        self.sent = {u: _planes_sent(recipe, u) for u in
                     ((True, False), (False, True), (True, True))}

    def _alloc_scales(self, device):
        rows, cols = self.shape
        layouts = all_layouts(self.recipe, rows, cols)
        want = (1, 3) if isinstance(self.recipe, MXFP8) else (1,)
        self.scales = [None, None]
        for slot, i in enumerate((1, 3)):
            if i in want:
                lay = layouts[i]
                self.scales[slot] = torch.full(lay.shape, lay.fill,
                                               dtype=_arrays.numpy_to_torch_dtype(lay.dtype), device=device)
        self._wrap_scales()

    def _wrap_scales(self):
        if self.scales[0].is_meta:  # no data to import until materialized
            self.scale_tensor = None
            return
        internal = [None if t is None else _arrays.to_internal(t)[0] for t in self.scales]
        # scales only: the master cast writes data bytes into fragments (the local rows)
        self.scale_tensor = from_internal(self.shape, self.recipe,
                                          [None, internal[0], None, internal[1]],
                                          _arrays.numpy_dtype(self.model_dtype),
                                          _arrays.TORCH)

    def __deepcopy__(self, memo):
        """The weight's definition, scales and shard place, copied; what ties it to FSDP2 (its
        FSDPParam and group, the module, the cached casts) is not: FSDP2's objects refuse
        deepcopy, and torch.distributed.checkpoint's async staging deep-copies the weights
        of a model in training (so does copy.deepcopy of a prepared model)."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.scales = copy.deepcopy(self.scales, memo)
        new._wrap_scales()
        new.registry = copy.deepcopy(self.registry, memo)
        new.fsdp = new.hook_module = new.mesh_place = None
        new.cast_items, new.frags, new.cast_version = {}, None, None
        new.gathers = collections.deque(maxlen=64)
        return new

    def materialize(self, device):
        """The scales on `device`, once the weight's planes left the meta device (FSDP2's
        ``model.to_empty(device=...)`` after a meta-device init, mode "cast"): their values
        come from the first cast."""
        self._alloc_scales(device)
        self.frags, self.cast_items, self.cast_version = None, {}, None

    @property
    def planes(self) -> tuple:
        """Byte planes a rank holds: ("row",) for Block2D, ("row", "col") for MXFP8."""
        return ("row", "col") if isinstance(self.recipe, MXFP8) else ("row",)

    def fsdp_for(self, module):
        """(FSDPParam, parameter group) of this weight, as the hook's `module` finds them:
        checked once per module, then kept (FSDP2 never moves a parameter to another
        group)."""
        if module is not self.hook_module or self.fsdp is None:
            self.fsdp = fsdp_param_of(self, module)
            self.hook_module = module
        return self.fsdp

    def place_on(self, mesh, outer_size):
        """(world, rank, chunk rows, cols) of this rank's shard on `mesh`: asked of the mesh
        once (DeviceMesh.size / get_local_rank cost ~25 Python calls) and kept while FSDP2
        passes the same mesh and size objects."""
        p = self.mesh_place
        if p is None or p[0] is not mesh or p[1] is not outer_size:
            ws = mesh.size()
            rows, cols = int(outer_size[0]), int(outer_size[-1])
            p = self.mesh_place = (mesh, outer_size, ws, mesh.get_local_rank(),
                                   cdiv(rows, ws), cols)
        return p[2:]

    def set_scales_from(self, q: BlockTensor):
        """Copy the global scales of a full-weight BlockTensor (conversion time)."""
        src = [q.rowwise_scale_inv, q.columnwise_scale_inv]
        for dst, s in zip(self.scales, src):
            if dst is not None:
                dst.copy_(s)


def _planes_sent(recipe, usage):
    """(plane names, their indices) the all-gather sends for `usage`: Block2D always the
    rowwise plane (the columnwise copy is its FP8 transpose), MXFP8 the planes needed."""
    if isinstance(recipe, Block2D):
        return ("row",), (0,)
    names = tuple(p for p, need in zip(("row", "col"), usage) if need)
    return names, tuple(("row", "col").index(p) for p in names)


# --------------------------------------------------------------------------------------------
# Sharded local tensors: a wrapper over same-shaped planes


class PlaneWeight(torch.Tensor):
    """Base of the sharded-side subclasses: ``_planes`` are inner tensors with the outer
    shape and strides (uint8 FP8 bytes, or the high-precision parameter); ``_state`` is the
    shared :class:`WeightState`."""

    @staticmethod
    def __new__(cls, planes, state, requires_grad=False):
        p0 = planes[0]
        return torch.Tensor._make_wrapper_subclass(
            cls, p0.shape, strides=p0.stride(), storage_offset=p0.storage_offset(),
            dtype=state.dtype, device=p0.device, requires_grad=requires_grad)

    def __init__(self, planes, state, requires_grad=False):
        self._planes = tuple(planes)
        self._state = state

    @property
    def planes(self) -> tuple:
        """The inner tensors: uint8 FP8 bytes, or the high-precision parameter first."""
        return self._planes

    @property
    def weight_state(self) -> "WeightState":
        """The shared :class:`WeightState` (recipe, global shape, scales, registry)."""
        return self._state

    def __repr__(self):
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, recipe={self._state.recipe!r}, "
                f"global shape={self._state.shape}, mode={self._state.mode})")

    def __reduce_ex__(self, protocol):
        # torch.save and torch.distributed.checkpoint (which torch.saves each local shard)
        # store the shard as a plain tensor of its high-precision values: a checkpoint any
        # model loads, without the FP8 state (device scales, the model's registry)
        return self.high_precision().__reduce_ex__(protocol)

    def high_precision(self) -> torch.Tensor:
        """This shard's values as a plain tensor of the weight's dtype (a compact copy)."""
        raise NotImplementedError

    def _clear_non_serializable_cached_data(self):
        # deepcopy / serialization: the cached hook (see _PreAllGatherHook) refers to this
        # tensor, not to a copy; it is set again at the copy's first gather
        super()._clear_non_serializable_cached_data()
        self.__dict__.pop("fsdp_pre_all_gather", None)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PLANE_OPS:
            return _plane_op(func, args, kwargs)
        if func is aten.is_pinned.default:  # a query (torch.distributed.checkpoint asks it)
            return args[0]._planes[0].is_pinned()
        return cls._other_op(func, args, kwargs)

    @classmethod
    def _other_op(cls, func, args, kwargs):
        raise NotImplementedError(f"{cls.__name__} does not support {func}")

    # -- FSDP2 extension -------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2 hook: the uint8 FP8 planes this rank sends (padded to FSDP's chunk rows) and
        metadata (the state, which planes, the usage). Scales do not travel: they are global
        and already on every rank."""
        if "fsdp_pre_all_gather" not in self.__dict__:
            self.fsdp_pre_all_gather = _PreAllGatherHook(self)
        state = self._state
        group = state.fsdp_for(module)[1]
        usage = usage_for(group)
        planes, index = state.sent[usage]
        ws, rank, chunk, cols = state.place_on(mesh, outer_size)
        inputs = self._local_bytes(chunk, index)
        if state.log_gathers:
            state.gathers.append({"state": state_name(group), "usage": usage,
                                  "planes": planes, "bytes": chunk * cols * len(planes),
                                  "world": ws, "padded_numel": chunk * cols * ws})
        return inputs, (state, planes, usage)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: the unsharded :class:`Float8BlockWeight` (first gather) or ``out``
        updated in place (later gathers; its version counter unchanged)."""
        state, planes, usage = metadata
        if out is not None:
            # FSDP2 + TP passes the DTensor it built around our tensor the first time
            inner = out if isinstance(out, Float8BlockWeight) else out._local_tensor
            # No torch op reads or writes `out` here: the box repoints its BlockTensor and
            # writes only its own columnwise tensor (on the GPU a kernel on torch's current
            # stream), so neither no_grad nor a version-counter guard is needed (~15 Python
            # calls per gather)
            inner._box.update(all_gather_outputs, planes, usage)
            return None
        # the unsharded weight claims FSDP's compute dtype (mp_policy.param_dtype, else the
        # parameter's): the Linear produces the weight gradient in it
        box = _GatheredBox(state, param_dtype or state.dtype)
        box.update(all_gather_outputs, planes, usage)
        return Float8BlockWeight(box), box.inner_tensors()


def _plane_op(func, args, kwargs):
    state = next(a._state for a in _flat(args) if isinstance(a, PlaneWeight))
    cls = next(type(a) for a in _flat(args) if isinstance(a, PlaneWeight))
    nplanes = len(next(a._planes for a in _flat(args) if isinstance(a, PlaneWeight)))
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        if not isinstance(src, PlaneWeight):
            return cls._copy_from_plain(dst, src)
        for d, s in zip(dst._planes, src._planes):
            d.copy_(s)
        return dst
    outs = []
    for i in range(nplanes):
        a_i = tree_map_only(PlaneWeight, lambda t: t._planes[i], args)
        k_i = dict(kwargs)
        if func in _NEW_OPS:  # keep each plane's own dtype (uint8 bytes stay bytes)
            src = next(a for a in _flat(args) if isinstance(a, PlaneWeight))
            if "dtype" in k_i and k_i["dtype"] is not None and k_i["dtype"] != state.dtype:
                if func is aten._to_copy.default:
                    raise NotImplementedError(
                        f"{cls.__name__}: converting to {k_i['dtype']} is not supported "
                        f"(the weight is {state.dtype}); dequantize explicitly")
            k_i["dtype"] = src._planes[i].dtype
        outs.append(func(*a_i, **k_i))
    if isinstance(outs[0], (list, tuple)):
        return type(outs[0])(cls(list(parts), state) for parts in zip(*outs))
    if state.scales[0].is_meta and not outs[0].is_meta:  # materialized (to_empty)
        state.materialize(outs[0].device)
    return cls(outs, state)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# FSDP2 (torch 2.11, FSDPParam.all_gather_inputs) calls inspect.signature on the pre-all-gather
# hook before every all-gather; a stored __signature__ saves it parsing the function each time
PlaneWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(
    PlaneWeight.fsdp_pre_all_gather)


class _PreAllGatherHook:
    """The pre-all-gather hook of one sharded tensor, set on it as an instance attribute at
    its first gather. inspect.signature of a bound method still rebuilds and re-validates the
    signature without ``self`` (~6 us per gather); of this object it returns the stored one
    (~1.5 us). It calls the class's hook, so patching the class (tests, the benchmark's timer)
    still takes effect, and holds the tensor weakly (no reference cycle)."""

    __slots__ = ("_tensor",)
    __signature__ = inspect.Signature(
        list(PlaneWeight.fsdp_pre_all_gather.__signature__.parameters.values())[1:])

    def __init__(self, tensor):
        self._tensor = weakref.ref(tensor)

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        t = self._tensor()
        return type(t).fsdp_pre_all_gather(t, mesh, outer_size, outer_stride, module, mp_policy)


class Float8BlockPrimaryWeight(PlaneWeight):
    """Mode "primary": the FP8 bytes of this rank's rows of an FP8 primary weight (see module doc).

    Planes: rowwise bytes uint8 (rows, K) and, for MXFP8, columnwise bytes uint8 (rows, K).
    Besides FSDP's reshaping/copying, reads (a norm for logging, ``DTensor.full_tensor``'s
    all-gather, a full state dict) see the dequantized values, as plain tensors; writes raise:
    the weights change only through :func:`fp8blk.torch.cast_master_weights_`."""

    @classmethod
    def _copy_from_plain(cls, dst, src):
        raise NotImplementedError(
            "copying a high-precision tensor into an FP8 primary weight is not supported: "
            "update the fp32 masters and call fp8blk.torch.cast_master_weights_(model, masters) "
            "(to resume from a checkpoint, load the masters through "
            "fp8blk.torch.checkpoint.master_state_dict, then cast)")

    @classmethod
    def _other_op(cls, func, args, kwargs):
        if func._schema.is_mutable:
            raise NotImplementedError(
                f"Float8BlockPrimaryWeight (mode 'primary', FP8 primary weights) does not support "
                f"{func}: the optimizer must update fp32 master shards "
                f"(fp8blk.torch.master_weights) and fp8blk.torch.cast_master_weights_ writes "
                f"the FP8 bytes")
        values = lambda t: t.high_precision()  # noqa: E731
        return func(*tree_map_only(Float8BlockPrimaryWeight, values, args),
                    **tree_map_only(Float8BlockPrimaryWeight, values, kwargs or {}))

    def _local_bytes(self, chunk, index):
        planes = self._planes
        registry = self._state.registry
        if registry is not None:                 # (a weight made by prepare_fsdp_fp8)
            registry.ensure_agreed("primary")    # before FSDP2's all-gather
        return tuple([_padded_rows(planes[i], chunk) for i in index])

    def high_precision(self) -> torch.Tensor:
        """The dequantized values of this rank's rows (global scales), in the weight's dtype:
        what a checkpoint of the model stores. Exact where the dtype holds FP8 value x scale
        (always with power-of-two scales)."""
        state = self._state
        if state.registry is None:
            raise RuntimeError("this FP8 primary weight has no model registry "
                               "(it was not made by prepare_fsdp_fp8)")
        return state.registry.local_values(state, self._planes[0]).to(state.dtype)


class Float8BlockCastWeight(PlaneWeight):
    """Mode "cast": a bf16/fp32 parameter shard that all-gathers as FP8 (see module doc).

    One plane, the high-precision tensor; every op other than FSDP's reshaping/copying runs
    on it (optimizer updates in place; results of other ops come back as plain tensors)."""

    @classmethod
    def _copy_from_plain(cls, dst, src):
        dst._planes[0].copy_(src)
        # a copy into a local shard that bypasses the DTensor (torch.distributed.checkpoint
        # loads into a detached alias of it) bumps no version counter the cast can see: the
        # alias is a new wrapper, and its planes were made below autograd's view tracking.
        # The shared state counts it, so the next all-gather re-casts (Registry.ensure_cast)
        dst._state.writes += 1
        return dst

    @classmethod
    def _other_op(cls, func, args, kwargs):
        a = _hp_args(args)
        k = {n: _hp_args(v) for n, v in kwargs.items()} if kwargs else kwargs
        out = func(*a, **k)
        if func._schema.is_mutable and args and isinstance(args[0], Float8BlockCastWeight):
            return args[0] if not isinstance(out, (list, tuple)) else out
        return out

    @property
    def hp(self) -> torch.Tensor:
        """The high-precision parameter data (a plain tensor sharing storage)."""
        return self._planes[0]

    def high_precision(self) -> torch.Tensor:
        """The high-precision parameter values, compact (a view into a larger storage, as
        FSDP2's padded shards are, is copied): what a checkpoint of the model stores."""
        t = self._planes[0].detach()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() \
                or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        return t

    def _local_bytes(self, chunk, index):
        state = self._state
        state.registry.ensure_cast(state)
        frags = state.frags
        return tuple([frags[i] for i in index])


def _hp_args(x):
    """`x` with each Float8BlockCastWeight replaced by its high-precision plane, inside
    lists and tuples too (foreach optimizer ops take lists). An aten op's arguments hold no
    other containers; pytree's tree_map costs ~160 Python calls per optimizer op."""
    if isinstance(x, Float8BlockCastWeight):
        return x._planes[0]
    t = type(x)
    if t is tuple or t is list:
        return t([_hp_args(v) for v in x])
    return x


def _padded_rows(plane, chunk):
    """(chunk, K) uint8 view (or copy) of a (rows, K) plane: FSDP all-gathers its padded
    chunk size from every rank. A plane FSDP padded itself is a view into a chunk-sized
    buffer, so the view costs nothing; otherwise (rare) the rows are copied."""
    rows = plane.shape[0]
    if rows == chunk:
        return plane
    cols = plane.shape[1]
    need = plane.storage_offset() + chunk * cols
    if plane.untyped_storage().nbytes() >= need and plane.is_contiguous():
        return torch.as_strided(plane, (chunk, cols), (cols, 1))
    out = plane.new_zeros((chunk, cols))
    out[:rows].copy_(plane)
    return out


# --------------------------------------------------------------------------------------------
# The unsharded (gathered) weight


class _GatheredBlockTensor(BlockTensor):
    """A BlockTensor whose torch-side buffers are the very torch tensors it was built from
    (FSDP's all-gather outputs and fp8blk's scale tensors), not DLPack re-exports of its
    internal arrays. A Linear that saves these buffers for its backward pass thus saves
    views of FSDP's storage, which FSDP refills in place when it re-gathers for the backward
    pass (a DLPack export would keep a raw pointer to memory FSDP freed after forward).

    Needs only the public internal door ``internal_buffers``; the buffer-to-torch map holds
    (internal array, torch tensor) pairs per slot, used while the slot still holds that
    array."""

    __slots__ = ("_torch",)

    @classmethod
    def empty(cls, shape, recipe, dtype):
        self = from_internal(tuple(shape), recipe, [None, None, None, None], dtype,
                             _arrays.TORCH, cls)
        self._torch = [None, None, None, None]
        return self

    def _out(self, i):
        pair = self._torch[i]
        if pair is not None and internal_buffers(self)[i] is pair[0]:
            return pair[1]
        return super()._out(i)


class _GatheredBox:
    """The gathered weight's storage, shared by the unsharded parameter and its aliases:
    the BlockTensor, the torch tensors behind its buffers, and a cache of their internal
    (NumPy/CuPy) arrays keyed by address, so a re-gather into the same memory re-imports
    nothing (a DLPack import costs ~24 us on the GPU). The scale tensors (the global scales,
    and the Block2D columnwise copy's) are never reallocated: imported once, here."""

    def __init__(self, state, dtype):
        self.state = state
        self.dtype = dtype
        rows, cols = state.shape
        recipe = state.recipe
        lay = all_layouts(recipe, rows, cols)
        self.block2d = isinstance(recipe, Block2D)
        self.col_data = None
        col_sinv = state.scales[1]
        if self.block2d:
            dev = state.scales[0].device
            # reused across iterations; its storage is FSDP's to free and re-allocate
            self.col_data = torch.empty(lay[2].shape, dtype=torch.uint8, device=dev)
            col_sinv = torch.empty(lay[3].shape, dtype=torch.float32, device=dev)
        self._internal = {}
        self.q = _GatheredBlockTensor.empty(state.shape, recipe,
                                            _arrays.numpy_dtype(state.model_dtype))
        self.row_sinv = self._import("row_sinv", state.scales[0], 1)
        self.col_sinv = self._import("col_sinv", col_sinv, 3)

    def inner_tensors(self):
        return [self.col_data] if self.col_data is not None else []

    def _import(self, key, t, slot):
        """Internal array of torch tensor `t` for BlockTensor slot `slot` (re-imported only
        when its address or shape changed), registered as that slot's torch view."""
        hit = self._internal.get(key)
        sig = (t.data_ptr(), tuple(t.shape), t.dtype)
        if hit is None or hit[0] != sig:
            # NumPy on the CPU; on the GPU the torch tensor itself (torch-native buffers)
            hit = self._internal[key] = (sig, _arrays.to_internal(t)[0])
        self.q._torch[slot] = (hit[1], t)
        return hit[1]

    def update(self, outputs, planes, usage):
        """Point the BlockTensor at freshly gathered planes; make or drop the columnwise
        copy as `usage` = (rowwise, columnwise) says."""
        rows = self.state.shape[0]
        bufs = internal_buffers(self.q)
        bufs[0] = bufs[1] = bufs[2] = bufs[3] = None
        for name, t in zip(planes, outputs):
            if t.shape[0] != rows:  # FSDP padded the weight to world x chunk rows
                t = t[:rows]
            if name == "row":
                bufs[0], bufs[1] = self._import("row", t, 0), self.row_sinv
            else:
                bufs[2], bufs[3] = self._import("col", t, 2), self.col_sinv
        if self.block2d:
            rowwise, columnwise = usage
            if columnwise:
                self._make_columnwise()
            elif self.col_data.untyped_storage().nbytes():
                self.col_data.untyped_storage().resize_(0)  # not needed in this pass
            if not rowwise:
                bufs[0] = bufs[1] = None  # only the transpose is needed: release rowwise

    def _make_columnwise(self):
        """Block2D: FP8 transpose of the gathered rowwise bytes into the reused buffers."""
        storage = self.col_data.untyped_storage()
        need = self.col_data.numel()
        if storage.nbytes() != need:
            storage.resize_(need)
        bufs = internal_buffers(self.q)
        bufs[2], bufs[3] = self._import("col", self.col_data, 2), self.col_sinv
        self.q.create_columnwise()

    def block_tensor(self, rowwise=True, columnwise=False):
        q = self.q
        if columnwise and not q.has_columnwise:
            if not isinstance(self.state.recipe, Block2D):
                raise RuntimeError(
                    "this MXFP8 weight was gathered without its columnwise plane (FSDP gathers "
                    "the planes the pass needs: rowwise in forward, columnwise in backward "
                    "when reshard_after_forward=True); MXFP8 columnwise data cannot be derived "
                    "from rowwise data")
            if not q.has_rowwise:
                raise RuntimeError("the gathered weight holds no data (it was resharded)")
            self._make_columnwise()
        if rowwise and not q.has_rowwise:
            if not isinstance(self.state.recipe, Block2D):
                raise RuntimeError(
                    "this MXFP8 weight was gathered for the backward pass (columnwise plane "
                    "only); its rowwise data is not here")
            q.update_usage(rowwise=True)
        return q


class Float8BlockWeight(torch.Tensor):
    """The unsharded FP8 weight FSDP2 builds after the all-gather (both modes).

    ``fp8blk_block_tensor(rowwise, columnwise)`` returns the :class:`fp8blk.BlockTensor`
    (Block2D or MXFP8, family torch) without requantizing; a Block2D columnwise copy not yet
    made is made by FP8 transpose. Any other torch op sees the dequantized weight (a plain
    tensor of the nominal dtype)."""

    @staticmethod
    def __new__(cls, box, requires_grad=False):
        state = box.state
        return torch.Tensor._make_wrapper_subclass(
            cls, state.shape, dtype=box.dtype, device=state.scales[0].device,
            requires_grad=requires_grad)

    def __init__(self, box, requires_grad=False):
        self._box = box

    def __repr__(self):
        return f"Float8BlockWeight(shape={tuple(self.shape)}, {self._box.q!r})"

    def fp8blk_block_tensor(self, rowwise: bool = True, columnwise: bool = False):
        return self._box.block_tensor(rowwise, columnwise)

    def dequantize(self) -> torch.Tensor:
        q = self._box.q
        return q.dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return cls(args[0]._box)
        if func in (aten.as_strided.default, aten.view.default, aten._unsafe_view.default):
            src, size = args[0], tuple(args[1])
            if size == tuple(src.shape) and (func is not aten.as_strided.default or (
                    tuple(args[2]) == tuple(src.stride()) and (len(args) < 4 or not args[3]))):
                return cls(src._box)
        if func._schema.is_mutable and args and isinstance(args[0], Float8BlockWeight):
            raise NotImplementedError(f"Float8BlockWeight is read-only ({func})")
        a = tree_map_only(Float8BlockWeight, lambda t: t.dequantize(), args)
        k = tree_map_only(Float8BlockWeight, lambda t: t.dequantize(), kwargs)
        return func(*a, **k)


__all__ = ["WeightState", "PlaneWeight", "Float8BlockPrimaryWeight", "Float8BlockCastWeight",
           "Float8BlockWeight"]
