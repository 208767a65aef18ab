"""The sharded FSDP2 weight subclasses (modes "primary" and "cast") that all-gather FP8 bytes,
their shared :class:`WeightState`, and what fp8blk reads of FSDP2's state (its private
training-state attributes, torch >= 2.6). The gathered weight is :mod:`.gathered`; the
design: docs/torch.md ("FSDP2 with FP8 weights")."""
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
from ...tensor import from_internal
from .gathered import Float8BlockWeight, GatheredBox

# FSDP2's state, read once per hook: its names are imported at the first hook
# (torch.distributed may be missing from a torch build)

_FSDP = {}  # FSDP2's names, filled by _fsdp()
_NAMES = {}  # id(TrainingState member) -> its name (Enum.name and hash are Python calls)


def _fsdp():
    if not _FSDP:
        from torch.distributed._composable_state import _get_module_state
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        _FSDP.update(get_module_state=_get_module_state, FSDPState=FSDPState,
                     PRE_BACKWARD=TrainingState.PRE_BACKWARD)
    return _FSDP


def fsdp_param_of(state, module):
    """(FSDPParam, FSDP2 parameter group) of the weight of `state` (the hook's `module` owns
    it). Raises RuntimeError when FSDP state has no parameter group (as TransformerEngine
    does). The hooks call it once per module and keep the answer (:class:`WeightState`)."""
    names = _fsdp()
    st = names["get_module_state"](module) if module is not None else None
    if isinstance(st, names["FSDPState"]) and st._fsdp_param_group is None:
        raise RuntimeError(
            f"FSDP2 state of {type(module).__name__} has no parameter group, so the FP8 "
            f"weight cannot tell the training state (forward / backward) it is gathered for: "
            f"call fully_shard on a module that holds the weight's parameters")
    hit = state.registry.fsdp_of(state) if state.registry is not None else None
    if hit is None:
        raise RuntimeError(
            f"no FSDP2 parameter group holds this FP8 weight ({state.shape}): convert the "
            f"model with prepare_fsdp_fp8 and then call fully_shard on it")
    return hit


def param_group_of(state, module):
    """FSDP2 parameter group holding the weight of `state` (see :func:`fsdp_param_of`)."""
    return fsdp_param_of(state, module)[1]


def usage_for(group):
    """(rowwise, columnwise) the gathered weight must provide, from the group's training
    state: PRE_BACKWARD -> columnwise (dgrad); forward with reshard_after_forward -> rowwise;
    forward without resharding -> both (the backward pass reuses this gather). (FSDP runs the
    hooks under no_grad, so an inference-only forward cannot be told apart here.)"""
    if group._training_state is (_FSDP or _fsdp())["PRE_BACKWARD"]:
        return False, True
    if group._reshard_after_forward:
        return True, False
    return True, True


def state_name(group) -> str:
    st = group._training_state
    name = _NAMES.get(id(st))
    if name is None:
        name = _NAMES[id(st)] = st.name
    return name


def shard_place(fsdp_param, rows, cols):
    """(first flat index, element count, chunk rows) of this rank's FSDP2 shard of an
    (rows, cols) weight: torch.chunk along dim 0, ceil(rows / world) rows per rank."""
    ws = fsdp_param.mesh_info.shard_mesh_size
    rank = fsdp_param.mesh_info.shard_mesh_rank
    chunk = cdiv(rows, ws)
    r0 = min(rank * chunk, rows)
    r1 = min(r0 + chunk, rows)
    return r0 * cols, (r1 - r0) * cols, chunk


def local_of(fsdp_param):
    """The sharded parameter's local tensor (FSDPParam._sharded_local_tensor without its
    typing.cast: two Python calls per weight per step)."""
    return fsdp_param.sharded_param._local_tensor


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

    def set_scales(self, rowwise_scale_inv, columnwise_scale_inv):
        """Copy the global scales of the full weight's quantization (conversion time; None
        for a direction not quantized)."""
        for dst, s in zip(self.scales, (rowwise_scale_inv, columnwise_scale_inv)):
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
            inner.regathered(all_gather_outputs, planes, usage)
            return None
        # the unsharded weight claims FSDP's compute dtype (mp_policy.param_dtype, else the
        # parameter's): the Linear produces the weight gradient in it
        box = GatheredBox(state, param_dtype or state.dtype)
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
    signature without ``self`` on every gather; of this object it returns the stored one. It calls the class's hook, so patching the class (tests, the benchmark's timer)
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


__all__ = ["WeightState", "PlaneWeight", "Float8BlockPrimaryWeight", "Float8BlockCastWeight",
           "Float8BlockWeight", "fsdp_param_of", "param_group_of", "usage_for", "state_name",
           "shard_place", "local_of"]
