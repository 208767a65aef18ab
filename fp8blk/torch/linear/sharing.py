"""Quantize once per activation: Float8BlockLinear layers that read the same tensor share its
FP8 copies.

In a transformer block several layers read one activation: q, k and v the attention norm's
output, gate and up the MLP norm's. Each Float8BlockLinear quantizes its input itself (rowwise
for its forward GEMM, columnwise to save for its weight gradient), so without sharing that
tensor is quantized three times (twice) and three (two) identical columnwise copies are kept
between the passes. Inside a sharing scope the first layer's quantization is reused by the
others: one quantize per distinct activation, one saved columnwise copy (autograd saves the
same tensor objects in each layer's node, so their storage is held once), the same bytes
(the quantization is a deterministic function of the input's values and the recipe).

Scope. Sharing happens only inside :func:`sharing` (a context manager), which
``convert_to_float8_block`` (by default; ``share_quantize=False`` does not) opens around every
forward call of the converted model (:func:`install`: a forward pre-hook and an always-called forward hook on the
root module). Outside a scope nothing is cached and every layer quantizes its input, as
without this module.

What is cached, and for how long. Per scope, a dict keyed by ``id(x)`` of the layer's input
``x`` (the tensor passed to the layer, before its 2-D view) holding a weak reference to x, x's
version counter and data pointer when quantized, and the quantized buffers per
``(path, recipe, rowwise, columnwise)`` (``path``: the per-signature plan's buffer views or
the general path's, which hold the same bytes seen differently). An entry is used only while
the weak reference still gives x itself, x's ``_version`` is unchanged (an in-place update of
x, or of any view of its storage, bumps it) and x's data pointer is unchanged; otherwise it is
replaced. The cache holds no reference to x: the entry is removed when x is freed (the weak
reference's callback), and the whole cache when the scope closes, so a rowwise copy lives no
longer than x and the forward pass, and a columnwise copy as long as the last layer that
saved it (autograd's references; the cache's goes with the scope).

Safety.

* Activation checkpointing: a recomputation in the backward pass runs outside the forward's
  scope, so each layer quantizes again (the same bytes, so the saved tensors' metadata match
  what ``torch.utils.checkpoint`` checks); under a reentrant checkpoint the forward pass runs
  without grad and asks for rowwise copies only, a different key.
* In-place updates: the version counter and data pointer checks above; an inference tensor
  (no version counter) is never shared.
* ``torch.compile``: this cache is skipped while tracing (:func:`for_input` returns None; the
  hooks return at once). A compiled layer quantizes x in an op of its own, a pure function of
  x (``fp8blk::linear_quantize_x`` where a plan serves the signature, ``fp8blk::quantize``
  otherwise: :mod:`fp8blk.torch.linear.compiled`), so siblings reading one x within one
  compiled graph make identical nodes, which AOTAutograd's CSE pass merges (run on the joint
  graph by the min-cut partitioner, inductor's default: ``torch/_functorch/partitioners.py``,
  ``min_cut_rematerialization_partition``): one quantize and one saved columnwise copy per
  distinct activation in the graph, whether or not ``share_quantize`` is set. An in-place
  update of x makes a new node (functionalization), so nothing stale is merged; layers in
  different graphs (a graph break between them) do not share. ``backend="aot_eager"`` uses
  the default partitioner, which does not run CSE.
* CUDA graphs: a captured forward that ran inside a scope replays the same launches, one
  quantize per activation reading the static input's memory; the cache dies with the scope,
  so nothing from the capture's pool is reused outside it. ``make_graphed_callables`` of a
  single layer runs without a scope.
* ``Float8BlockConfig(low_memory_forward=True)`` layers do not share (their rowwise copy is
  made and freed in halves of the tokens).

One scope per thread (a ``threading.local``): the forward runs on the caller's thread;
autograd's backward threads never quantize activations.

    from fp8blk.torch import convert_to_float8_block
    convert_to_float8_block(model)        # share_quantize=True by default
    with sharing.counting() as stats:     # tests: how often layers quantized / reused
        model(x)
    stats.misses, stats.hits
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

_local = threading.local()
_compiling = torch.compiler.is_compiling


class Stats:
    """Counts of a :func:`counting` block: ``misses`` (quantizations made) and ``hits``
    (quantizations reused), over every scope closed or open in it on this thread."""

    __slots__ = ("misses", "hits")

    def __init__(self):
        self.misses = self.hits = 0


class _Entry:
    __slots__ = ("ref", "version", "ptr", "copies")

    def __init__(self, ref, version, ptr):
        self.ref, self.version, self.ptr, self.copies = ref, version, ptr, {}


class _Scope:
    __slots__ = ("entries", "__weakref__")

    def __init__(self):
        self.entries = {}

    def get(self, x, key, make, args):
        entries = self.entries
        i = id(x)
        ent = entries.get(i)
        version, ptr = x._version, x.data_ptr()
        if ent is None or ent.ref() is not x or ent.version != version or ent.ptr != ptr:
            ent = entries[i] = _Entry(weakref.ref(x, _dropper(self, i)), version, ptr)
        out = ent.copies.get(key)
        stats = getattr(_local, "stats", None)
        if out is None:
            out = ent.copies[key] = make(*args)
            if stats is not None:
                stats.misses += 1
        elif stats is not None:
            stats.hits += 1
        return out


def _dropper(scope, i):
    """The weak reference's callback: removes entry `i` if it is still the one for that
    reference (a newer tensor may have been given the freed tensor's id since)."""
    scope_ref = weakref.ref(scope)

    def drop(ref):
        s = scope_ref()
        if s is not None:
            ent = s.entries.get(i)
            if ent is not None and ent.ref is ref:
                del s.entries[i]
    return drop


class _Sharer:
    """``share(path, make, *args)``: the cached buffers of x for `path` and this key, else
    ``make(*args)``, cached."""

    __slots__ = ("scope", "x", "key")

    def __init__(self, scope, x, key):
        self.scope, self.x, self.key = scope, x, key

    def __call__(self, path, make, *args):
        return self.scope.get(self.x, (path,) + self.key, make, args)


def for_input(x, cfg, need_columnwise: bool):
    """A sharer for layer input `x` quantized with ``cfg.activation`` rowwise (and columnwise
    when `need_columnwise`), or None when no scope is open on this thread, while tracing, for
    an inference tensor or a ``low_memory_forward`` config (the caller then quantizes)."""
    stack = getattr(_local, "stack", None)
    if not stack or _compiling() or cfg.low_memory_forward or x.is_inference():
        return None
    return _Sharer(stack[-1], x, (cfg.activation, True, bool(need_columnwise)))


@contextlib.contextmanager
def sharing():
    """A sharing scope on this thread (nested scopes each have their own cache)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    scope = _Scope()
    stack.append(scope)
    try:
        yield
    finally:
        stack.remove(scope)
        scope.entries.clear()


@contextlib.contextmanager
def counting():
    """Count the quantizations made and reused on this thread inside the block (yields a
    :class:`Stats`)."""
    prev = getattr(_local, "stats", None)
    stats = _local.stats = Stats()
    try:
        yield stats
    finally:
        _local.stats = prev


def _open(module, args):
    if _compiling():
        return
    ctx = sharing()
    ctx.__enter__()
    module.__dict__.setdefault("_fp8blk_share_scopes", []).append(ctx)


def _close(module, args, output):
    if _compiling():
        return
    scopes = module.__dict__.get("_fp8blk_share_scopes")
    if scopes:
        scopes.pop().__exit__(None, None, None)


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Open a sharing scope around every forward call of `model` (idempotent). Returns
    `model`."""
    if not getattr(model, "_fp8blk_share_installed", False):
        model.register_forward_pre_hook(_open)
        model.register_forward_hook(_close, always_call=True)
        model._fp8blk_share_installed = True
    return model


__all__ = ["sharing", "counting", "install", "for_input", "Stats"]
