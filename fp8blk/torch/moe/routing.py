"""The experts' token layout: routed (token, expert) pairs sorted by expert into segments that
start on 128-row boundaries, with the offsets on the device (docs/torch.md, "Experts").

A segment padded to a multiple of 128 rows with zero rows (DeepGEMM's "contiguous" layout)
makes every 128-row tile and every 128x1 block of the sorted tokens belong to one expert, so
the grouped operands are fp8blk's ordinary buffers: quantizing the padded rows columnwise
gives, for each expert, the bytes ``fb.quantize`` gives for its rows alone (zero rows change
no block's amax and quantize to zero bytes), and each expert's GEMM operand is a plain slice.
The row count of the padded layout is fixed by the shapes alone (:func:`padded_rows`), so
routing needs no host synchronization: a step runs ahead of the GPU.

    import torch
    from fp8blk.torch.moe.routing import route, permute, combine
    hidden = torch.randn(6, 256); idx = torch.tensor([[0, 2]] * 6); w = torch.ones(6, 2) / 2
    r = route(idx, num_experts=4)
    x = permute(hidden, r)                     # (r.rows, 256): expert 0 rows 0..5, 2 at 128..133
    out = combine(x, r, w, hidden.dtype)       # the mean of each token's two rows: hidden
"""
from __future__ import annotations

import torch

from ...layout import round_up

ALIGN = 128


def padded_rows(pairs: int, num_experts: int) -> int:
    """The row count of the padded layout of ``pairs`` routed (token, expert) pairs over
    ``num_experts`` experts: enough for any routing (each non-empty expert pads at most 127
    rows), a multiple of 128."""
    if pairs == 0:
        return 0
    bound = pairs + (ALIGN - 1) * min(num_experts, pairs)
    return round_up(bound, ALIGN)


class Routing:
    """One routing of T tokens to k experts each, in the padded layout (module docstring).

    ``ids`` (T*k,) int64: the expert of pair ``t*k + j``; ``dest`` (T*k,) int64: the padded row of pair ``t*k + j`` (token t's j-th expert);
    ``starts`` / ``counts`` (E,) int64 on the device: each expert's first padded row and its
    routed row count; ``padded`` (E,) its segment length (counts rounded up to 128);
    ``table`` (3, E) int64: starts, padded and counts stacked (what the per-expert ops read);
    ``rows``: the padded row count (:func:`padded_rows`); ``tokens``, ``top_k``,
    ``num_experts``. :meth:`pairs` / :meth:`sources` give each padded row's pair / token and
    :meth:`tile_experts` gives each 128-row tile's expert on the device;
    :meth:`host` gives the segments as Python lists (one device
    synchronization, then cached) for the per-expert GEMM loop; ``host``, when the caller
    knows the segments already (the expert-parallel layout, built from host counts), sets
    them."""

    def __init__(self, ids, dest, starts, counts, padded, rows, tokens, top_k, num_experts,
                 host=None):
        self.ids, self.dest, self.starts, self.counts = ids, dest, starts, counts
        self.padded = padded
        self.rows, self.tokens, self.top_k, self.num_experts = rows, tokens, top_k, num_experts
        self.table = torch.stack([starts, padded, counts])
        self._host = host
        self._valid = None
        self._tiles = None
        self._sources = None
        self._pairs = None

    def host(self):
        """``[(start, padded_length, count), ...]`` per expert, as Python ints."""
        if self._host is None:
            self._host = host_table(self.table)
        return self._host

    def valid_rows(self):
        """(rows,) bool: whether each padded row holds a routed pair (padding rows: False)."""
        if self._valid is None:
            self._valid = torch.zeros(self.rows, dtype=torch.bool, device=self.dest.device)
            # index_fill_, not ``[dest] = True``: that indexed store synchronizes on CUDA
            self._valid.index_fill_(0, self.dest, True)
        return self._valid


    def pairs(self):
        """(rows,) int64 on the device: the routed pair ``t*k + j`` each padded row holds,
        ``tokens * top_k`` for a padding row (the inverse of ``dest``), computed once per
        routing."""
        if self._pairs is None:
            n = self.tokens * self.top_k
            pairs = torch.full((self.rows,), n, dtype=torch.int64, device=self.dest.device)
            self._pairs = pairs.index_copy_(0, self.dest,
                                            torch.arange(n, device=self.dest.device))
        return self._pairs

    def sources(self):
        """(rows,) int64 on the device: the token each padded row holds, ``tokens`` for a
        padding row (:func:`permute` gathers through it), computed once per routing."""
        if self._sources is None:
            self._sources = self.pairs() // self.top_k
        return self._sources

    def tile_experts(self):
        """(rows/128,) int32 on the device: each 128-row tile's expert (:func:`tile_experts`),
        computed once per routing."""
        if self._tiles is None:
            self._tiles = tile_experts(self.padded, self.rows)
        return self._tiles


def tile_experts(padded: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows/128,) int32: the expert of each 128-row tile of the padded layout whose segment
    lengths are ``padded`` (E,) (multiples of 128), E for a tile past the last segment; on
    the device, no synchronization (the one-launch grouped GEMM reads it)."""
    ends = torch.cumsum(padded, 0) // ALIGN
    tiles = torch.arange(rows // ALIGN, device=padded.device)
    return torch.searchsorted(ends, tiles, right=True).to(torch.int32)


def host_table(table: torch.Tensor) -> list:
    """``[(start, padded, count), ...]`` per expert of a routing table (3, E) (one device
    read)."""
    return list(zip(*table.tolist()))


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """The padded layout of a routing. ``top_k_index`` (T, k) integer expert ids in
    ``[0, num_experts)`` (a router's top-k choice); every op stays on its device."""
    if top_k_index.dim() != 2:
        raise ValueError(f"route: top_k_index must be (tokens, top_k), got shape "
                         f"{tuple(top_k_index.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"route: top_k_index must hold integer expert ids, got "
                        f"{top_k_index.dtype}")
    if num_experts < 1:
        raise ValueError(f"route: num_experts must be >= 1, got {num_experts}")
    tokens, top_k = top_k_index.shape
    pairs = tokens * top_k
    dev = top_k_index.device
    ids = top_k_index.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + (ALIGN - 1)) // ALIGN * ALIGN
    starts = torch.cumsum(padded, 0) - padded
    # a stable sort keeps each expert's pairs in token order (what grouped_mm's sort gives)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    first = torch.cumsum(counts, 0) - counts          # each expert's first sorted position
    rank = torch.arange(pairs, device=dev) - first[sorted_ids]
    dest = torch.empty_like(ids)
    dest[order] = starts[sorted_ids] + rank
    return Routing(ids, dest, starts, counts, padded, padded_rows(pairs, num_experts), tokens,
                   top_k, num_experts)


def gather_rows(hidden: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """(len(sources), H): row i is ``hidden[sources[i]]``, zeros where ``sources[i]`` is T
    (``Routing.sources``: a padding row). One gather writes every row (a padding row reads an
    appended zero row), instead of zeroing the rows, copying each token k times and
    scattering the copies."""
    return torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])[sources]


def _token_sums(grad, dest, tokens, top_k):
    # each token's k rows summed in one reduction (fp32 inside, one rounding): the order is
    # fixed, unlike an index_add's atomics
    return grad[dest].view(tokens, top_k, grad.shape[-1]).sum(1)


def permute_forward(hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
    """:func:`permute`'s output without autograd: (routing.rows, H) in hidden's dtype."""
    return gather_rows(hidden, routing.sources())


def permute_backward(grad: torch.Tensor, routing: Routing) -> torch.Tensor:
    """:func:`permute`'s input gradient, (T, H), from the padded rows' gradient ``grad``
    (routing.rows, H): each token's k rows summed (padding rows read by no token)."""
    return _token_sums(grad, routing.dest, routing.tokens, routing.top_k)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, dest, sources, top_k):
        ctx.save_for_backward(dest)
        ctx.shape = (hidden.shape[0], top_k)
        return gather_rows(hidden, sources)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        return _token_sums(grad, dest, *ctx.shape), None, None, None


def permute(hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(routing.rows, H): row ``routing.dest[t*k + j]`` holds ``hidden[t]``, every other row
    zeros. ``hidden`` (T, H) in any float dtype; differentiable (each token's gradient is the
    sum of its k rows' gradients)."""
    if hidden.dim() != 2 or hidden.shape[0] != routing.tokens:
        raise ValueError(f"permute: hidden must be ({routing.tokens}, H), got shape "
                         f"{tuple(hidden.shape)}")
    return _Permute.apply(hidden, routing.dest, routing.sources(), routing.top_k)


def combine(rows: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor, dtype):
    """(T, H) in ``dtype``: each token's k expert rows weighted by ``top_k_weights`` (T, k) and
    summed, as transformers' ``grouped_mm`` experts do (the product in the promoted dtype,
    the sum over k in one reduction, then the cast)."""
    if top_k_weights.shape != (routing.tokens, routing.top_k):
        raise ValueError(f"combine: top_k_weights must be ({routing.tokens}, "
                         f"{routing.top_k}), got shape {tuple(top_k_weights.shape)}")
    routing.pairs()         # made (once per routing) outside the node
    return weighted_sum(_Pick.apply(rows, routing), top_k_weights, dtype)


class _Pick(torch.autograd.Function):
    """``rows[routing.dest]`` (T*k, H), whose gradient is a gather: each padded row its pair's
    gradient, zeros for a padding row, in one pass writing the rows (autograd's index backward
    zeroes them, then scatters into them; under inductor a memset and an atomic scatter). The
    same bytes: a -0 lands as +0, as the accumulating put into zeros leaves it."""

    @staticmethod
    def forward(ctx, rows, routing):
        ctx.routing = routing
        return rows[routing.dest]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        out = gather_rows(grad, ctx.routing.pairs())
        return torch.where(out == 0, 0.0, out), None


def weighted_sum(picked: torch.Tensor, top_k_weights: torch.Tensor, dtype):
    """(T, H) in ``dtype``: ``picked`` (T*k, H), token t's k expert rows at ``t*k .. t*k+k-1``,
    weighted by ``top_k_weights`` (T, k) and summed over k (the product in the promoted dtype,
    one reduction, then the cast): :func:`combine`'s arithmetic, for rows already gathered
    (the expert-parallel combine)."""
    tokens, top_k = top_k_weights.shape
    weighted = picked * top_k_weights.reshape(-1).unsqueeze(-1)
    out = weighted.view(tokens, top_k, picked.shape[-1]).sum(1)
    # no `.to` when the dtype is already right: a no-op `.to` returns the same tensor, and an
    # autograd.Function returning it (grouped_linear_combine's node) got all-zero gradients
    # under torch.compile in torch 2.11 (its dynamo also returned the aliased intermediate
    # as a graph output, and AOTAutograd handed the real tangent to that one)
    return out if out.dtype == dtype else out.to(dtype)


__all__ = ["ALIGN", "Routing", "route", "padded_rows", "host_table", "tile_experts", "permute",
           "gather_rows", "permute_forward", "permute_backward", "combine", "weighted_sum"]
