"""Expert parallelism for fp8blk's experts: the experts of each converted transformers experts
module spread over the ranks of a communicator, tokens dispatched to their experts' ranks in
FP8 and the expert outputs combined back (docs/torch.md, "Expert parallelism").

One call of a module made expert-parallel by :func:`expert_parallel` (P ranks, E experts,
E/P per rank; rank r holds experts [r*E/P, (r+1)*E/P)):

1. the counts: each rank's routed (token, expert) pairs counted per expert and all-gathered in
   one small host collective (``Communicator.meta_all_gather``): every rank knows every send
   count, checks every rank's arguments from the same table and raises the same error;
2. the dispatch: the pairs sorted by expert (so by destination rank, each rank's rows grouped
   by local expert) and sent as FP8 rows with 1x128 scales (``fb.comm.quantized_all_to_all``:
   the bytes of quantizing the received rows), or as the model dtype's rows with
   ``fp8_dispatch=False``;
3. the experts: the received rows, ordered by source rank then token, laid out in the padded
   segments of ``routing`` (per local expert), the gate/up projection, the module's gating and
   the down projection as the single-rank path runs them (``grouped``);
4. the combine: the expert rows sent back in the model dtype
   (``fb.comm.high_precision_all_to_all``), weighted and summed per token where the token
   lives (``routing.weighted_sum``: autograd reaches the router through the weights).

The backward pass mirrors it: the output gradients' rows quantized 1x128 where the token lives
and sent in FP8 (the bytes the down projection's input-gradient GEMM takes), the input
gradients sent back in high precision and summed over each token's k rows. Under
``fp8_dispatch`` the expert rank holds no high-precision copy of the dispatched rows, so the
weight gradients' 128x1 (columnwise) operands are made from the received FP8 rows (dequantized
exactly, quantized 128x1: DeepSeek-V3's choice); with ``fp8_dispatch=False`` every byte is
the single-rank path's.

    import torch, transformers
    from fp8blk.comm import TorchComm
    from fp8blk.torch import convert_to_float8_block
    from fp8blk.torch.moe import expert_parallel
    # under torchrun, after torch.distributed.init_process_group(...)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    convert_to_float8_block(model, experts=True)
    expert_parallel(model, TorchComm())          # each rank keeps E/P experts per layer
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ...comm import (Communicator, TorchComm, high_precision_all_to_all,
                     quantized_all_to_all)
from ...comm.agree import fingerprint
from ...layout import all_layouts
from ..config import HIGH_DTYPES, fp8_dtype
from ..linear.functional import block_tensor_buffers, quantize_buffers
from ..scaled_mm import dequantize_operand
from .experts import expert_bias, gate, is_experts_module
from .gemms import (expert_weight_buffers, grouped_mm_rows, grouped_mm_weights,
                    grouped_row_sums)
from .routing import ALIGN, Routing, weighted_sum

# the per-call metadata row: CODE (0: fine, 1: this rank's arguments raised), EXPERTS, WIDTH,
# DTYPE (a fingerprint), then the pair count of each expert
CODE, EXPERTS, WIDTH, DTYPE, HEAD = 0, 1, 2, 3, 4


@functools.lru_cache(maxsize=64)
def _zero_row_scale(recipe) -> float:
    """The scale_inv ``fb.quantize`` gives a block of zeros under ``recipe`` (padding rows)."""
    return float(quantize_buffers(torch.zeros(1, 128), recipe, True, False)[1][0, 0])


class Plan:
    """One call's routing over the ranks (module docstring, steps 1-3).

    ``order`` (T*k,) int64 on the device: the pair (``t*k + j``) at each position of the
    expert-sorted rows; ``token_of``: ``order // k``; ``send`` / ``recv``: rows to / from
    each rank (Python ints); ``counts``: this rank's pairs per expert (E,) int64 on the
    device; ``routing``: the received rows' padded layout over the local experts (its
    ``dest``: each received row's padded row; ``tokens``: rows received)."""

    __slots__ = ("order", "token_of", "send", "recv", "counts", "routing", "tokens", "top_k")

    def __init__(self, order, token_of, send, recv, counts, routing, tokens, top_k):
        self.order, self.token_of, self.send, self.recv = order, token_of, send, recv
        self.counts, self.routing, self.tokens, self.top_k = counts, routing, tokens, top_k


class ExpertParallel:
    """The expert-parallel state of one experts module: ``comm`` (an fp8blk Communicator over
    the expert-parallel ranks), ``num_experts`` (E, all ranks'), ``local`` (E/P), ``first``
    (this rank's first expert) and ``fp8_dispatch``. :func:`expert_parallel` makes them;
    ``forward`` is what the module's ``fp8blk`` experts implementation runs."""

    def __init__(self, comm: Communicator, num_experts: int, fp8_dispatch: bool):
        self.comm, self.num_experts, self.fp8_dispatch = comm, num_experts, bool(fp8_dispatch)
        self.local = num_experts // comm.size
        self.first = comm.rank * self.local

    def __repr__(self):
        return (f"ExpertParallel(rank {self.comm.rank} of {self.comm.size}, experts "
                f"{self.first}..{self.first + self.local - 1} of {self.num_experts}, "
                f"fp8_dispatch={self.fp8_dispatch})")

    # -- step 1: counts and layouts ------------------------------------------------------------
    def plan(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> Plan:
        """Count, check on every rank, and lay out this call (one host synchronization for the
        counts, one metadata all_gather)."""
        e, comm = self.num_experts, self.comm
        row = np.zeros(HEAD + e, dtype=np.int64)
        error = None
        try:
            ids, counts = self._local_counts(hidden, top_k_index)
            row[HEAD:] = counts
            row[WIDTH] = hidden.shape[1]
            row[DTYPE] = fingerprint(str(hidden.dtype))
        except Exception as caught:  # every rank must learn of it, or its peers would wait
            error = caught
            row[CODE] = 1
        row[EXPERTS] = e
        table = comm.meta_all_gather(row)
        self._check_table(table, error)
        return self._layout(ids, table, hidden.device, top_k_index.shape)

    def _local_counts(self, hidden, top_k_index):
        if hidden.dim() != 2 or top_k_index.dim() != 2 \
                or top_k_index.shape[0] != hidden.shape[0]:
            raise ValueError(f"expert parallel: hidden_states (T, H) and top_k_index (T, k) "
                             f"expected, got shapes {tuple(hidden.shape)} and "
                             f"{tuple(top_k_index.shape)}")
        if hidden.dtype not in HIGH_DTYPES:
            raise TypeError(f"expert parallel: hidden_states must be float32, bfloat16 or "
                            f"float16, got {hidden.dtype}")
        if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
            raise TypeError(f"expert parallel: top_k_index must hold integer expert ids, got "
                            f"{top_k_index.dtype}")
        e = self.num_experts
        ids = top_k_index.reshape(-1).to(torch.int64)
        outside = ((ids < 0) | (ids >= e)).sum().reshape(1)
        counts = torch.bincount(ids.clamp(0, e - 1), minlength=e)
        host = torch.cat([counts, outside]).cpu().numpy()    # the one device read
        if host[-1]:
            raise ValueError(f"expert parallel: top_k_index holds {int(host[-1])} expert ids "
                             f"outside [0, {e})")
        return ids, host[:-1]

    def _check_table(self, table, error):
        bad = [r for r in range(table.shape[0]) if table[r, CODE]]
        if bad:
            if error is not None:
                raise error
            raise ValueError(f"expert parallel: the arguments of rank(s) {bad} raised (see "
                             f"their error); every rank stops here")
        for col, what in ((EXPERTS, "expert count"), (WIDTH, "hidden size"),
                          (DTYPE, "hidden_states dtype")):
            if (table[:, col] != table[0, col]).any():
                values = "" if col == DTYPE else f": {table[:, col].tolist()}"
                raise ValueError(f"expert parallel: the ranks disagree on the {what}{values}")

    def _layout(self, ids, table, device, index_shape) -> Plan:
        p, el, rank = self.comm.size, self.local, self.comm.rank
        counts = table[:, HEAD:]                                # (P, E): rank s -> expert e
        send = counts[rank].reshape(p, el).sum(1)
        by_source = counts[:, self.first:self.first + el]       # (P, E/P) received here
        recv = by_source.sum(1)
        n = by_source.sum(0)
        padded = (n + ALIGN - 1) // ALIGN * ALIGN
        starts = np.cumsum(padded) - padded
        # received rows come in blocks (source s, local expert e), s-major; block (s, e) lands
        # at expert e's segment after the rows of e from sources before s
        flat = by_source.reshape(-1)
        before = np.cumsum(by_source, 0) - by_source
        delta = (starts[None, :] + before).reshape(-1) - (np.cumsum(flat) - flat)
        received = int(flat.sum())
        as_t = functools.partial(torch.as_tensor, dtype=torch.int64, device=device)
        block = torch.repeat_interleave(as_t(np.arange(p * el)), as_t(flat),
                                        output_size=received)
        dest = as_t(delta)[block] + torch.arange(received, device=device)
        rows = int(padded.sum())
        host = list(zip(starts.tolist(), padded.tolist(), n.tolist()))
        routing = Routing(block % el, dest, as_t(starts), as_t(n), as_t(padded), rows,
                          received, 1, el, host=host)
        order = torch.argsort(ids, stable=True)
        top_k = index_shape[1]
        return Plan(order, order // top_k, send.tolist(), recv.tolist(),
                    as_t(counts[rank]), routing, index_shape[0], top_k)

    # -- steps 2 and 4: the all-to-alls --------------------------------------------------------
    def dispatch(self, rows, plan: Plan, recipe, rowwise: bool, columnwise: bool):
        """``rows`` (pairs, H) expert-sorted here -> the received rows' padded layout on the
        expert rank, quantized: ``(data, scale_inv, col_data, col_scale_inv, high)`` as
        ``quantize_buffers`` gives them for the padded rows (col_* only when asked for),
        ``high`` the padded rows in high precision (the received ones; under ``fp8_dispatch``
        the FP8 ones dequantized, which the columnwise copy is made from, or None when it is
        not asked for)."""
        routing = plan.routing
        if not self.fp8_dispatch:
            got, _, _ = high_precision_all_to_all(rows, self.comm, plan.send, plan.recv)
            high = got.new_zeros((routing.rows, got.shape[1]))
            high[routing.dest] = got
            q = quantize_buffers(high, recipe, rowwise, columnwise)
            return (*q, high)
        q, _, _ = quantized_all_to_all(rows, self.comm, plan.send, recipe, plan.recv)
        data, scale = block_tensor_buffers(q)[:2]
        width = rows.shape[1]
        lay = all_layouts(recipe, routing.rows, width)
        pdata = data.new_zeros((routing.rows, width))
        pdata[routing.dest] = data
        pscale = scale.new_full(lay[1].shape, _zero_row_scale(recipe))
        pscale[:, routing.dest] = scale[:, :routing.tokens]
        pscale[:, routing.rows:] = lay[1].fill
        if not columnwise:
            return pdata, pscale, None, None, None
        high = dequantize_operand(pdata.view(fp8_dtype(recipe.fmt)), pscale, "1x128")
        return pdata, pscale, *quantize_buffers(high, recipe, False, True)[2:], high

    def send_back(self, padded, plan: Plan):
        """``padded`` (routing.rows, N) on the expert rank -> (T*k, N) where the tokens live,
        in pair order (row ``t*k + j``: token t's j-th expert), high precision."""
        got, _, _ = high_precision_all_to_all(padded[plan.routing.dest], self.comm, plan.recv,
                                              plan.send)
        out = got.new_empty(got.shape)
        out[plan.order] = got
        return out

    def bias_grad(self, rows, plan: Plan, dtype):
        """The local experts' bias gradient (E/P, N) in ``dtype``: each expert's rows of
        ``rows`` (pairs, N), expert-sorted here, summed where the tokens live (fp32, in row
        order), the partial sums sent to the experts' ranks and added in source order: the
        single-rank sum up to fp32's summation order (for ``fp8_dispatch``, where the expert
        rank holds the gradient rows in FP8 only)."""
        partial = torch.segment_reduce(rows.float(), "sum", lengths=plan.counts, axis=0,
                                       unsafe=True)
        got = self.comm.all_to_all_v(partial, [self.local] * self.comm.size,
                                     [self.local] * self.comm.size)
        return got.view(self.comm.size, self.local, -1).sum(0).to(dtype)

    # -- the module's forward -------------------------------------------------------------------
    def forward(self, module, hidden, top_k_index, top_k_weights):
        """(T, H) in hidden's dtype: ``experts_forward``'s result for this rank's tokens."""
        plan = self.plan(hidden, top_k_index)
        device = hidden.device.type
        out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else hidden.dtype)
        first = "gate_up_proj" if module.has_gate else "up_proj"
        call = _Call(self, module, plan, out_dtype, torch.is_grad_enabled())
        picked = _ExpertParallelFn.apply(hidden, getattr(module, first),
                                         expert_bias(module, first), module.down_proj,
                                         expert_bias(module, "down_proj"), call)
        if getattr(module, "has_post_expert_norm", False):
            picked = module.post_expert_norm(picked)      # a per-row norm: where the rows are
        return weighted_sum(picked, top_k_weights, hidden.dtype)


class _Call:
    __slots__ = ("ep", "module", "plan", "out_dtype", "grad_enabled")

    def __init__(self, ep, module, plan, out_dtype, grad_enabled):
        self.ep, self.module, self.plan = ep, module, plan
        self.out_dtype, self.grad_enabled = out_dtype, grad_enabled


class _ExpertParallelFn(torch.autograd.Function):
    """hidden (T, H) -> the expert rows of every pair (T*k, H), pair order; differentiable in
    hidden and the four expert parameters (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, w1, b1, w2, b2, call):
        ep, module, plan = call.ep, call.module, call.plan
        cfg, routing = module.fp8blk_config, plan.routing
        act = fp8_dtype(cfg.activation.fmt)
        need_w1 = call.grad_enabled and w1.requires_grad
        xd, xs, xtd, xts, _ = ep.dispatch(hidden[plan.token_of], plan, cfg.activation, True,
                                          need_w1)
        w1d, w1s = expert_weight_buffers(w1, cfg.weight, module.is_transposed, True)
        h = grouped_mm_rows(xd.view(act), xs, w1d, w1s, routing, call.out_dtype, b1)
        with torch.no_grad():
            a = gate(module, h, routing).contiguous()
        ad, as_ = quantize_buffers(a, cfg.activation, True, False)[:2]
        del a
        w2d, w2s = expert_weight_buffers(w2, cfg.weight, module.is_transposed, True)
        y = grouped_mm_rows(ad.view(act), as_, w2d, w2s, routing, call.out_dtype, b2)
        picked = ep.send_back(y, plan)
        # saved: x's columnwise FP8 (the gate/up weight gradient), h (the gating's backward,
        # and a = gate(h) made again for the down projection's weight gradient), the weights
        # (parameters: held anyway)
        ctx.save_for_backward(xtd, xts, h, w1, w2)
        ctx.call = call
        ctx.x_dtype = hidden.dtype
        return picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dpicked):
        xtd, xts, h, w1, w2 = ctx.saved_tensors
        call = ctx.call
        ep, module, plan = call.ep, call.module, call.plan
        cfg, routing = module.fp8blk_config, plan.routing
        act, g = fp8_dtype(cfg.activation.fmt), fp8_dtype(cfg.grad.fmt)
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        transposed = module.is_transposed
        # the down projection: dY's rows quantized where the tokens live, sent in FP8
        sorted_rows = dpicked[plan.order]
        dyd, dys, dytd, dyts, dy = ep.dispatch(sorted_rows, plan, cfg.grad, True, need_w2)
        db2 = None
        if need_b2:
            db2 = (ep.bias_grad(sorted_rows, plan, dpicked.dtype) if ep.fp8_dispatch
                   else grouped_row_sums(dy, routing))
        del sorted_rows
        # the gating again, with autograd (its backward below): a's bytes of the forward pass
        with torch.enable_grad():
            leaf = h.detach().requires_grad_(True)
            a = gate(module, leaf, routing)
        # the input gradient first: its operands (dY's rows, W2.T) are dropped before dW2, a
        # parameter's size, is allocated
        w2td, w2ts = expert_weight_buffers(w2, cfg.weight, transposed, False)
        da = grouped_mm_rows(dyd.view(g), dys, w2td, w2ts, routing, h.dtype)
        del dy, dyd, dys, w2td, w2ts
        dw2 = None
        if need_w2:
            atd, ats = quantize_buffers(a.detach().contiguous(), cfg.activation, False, True)[2:]
            dw2 = grouped_mm_weights(dytd.view(g), dyts, atd.view(act), ats, routing, w2.dtype)
            dw2 = dw2.transpose(1, 2).contiguous() if transposed else dw2
            del atd, ats
        del dytd, dyts
        # the gating's backward: autograd's, on h (the single-rank path's bytes)
        (dh,) = torch.autograd.grad(a, leaf, da)
        del da, a
        dh = dh.contiguous()
        db1 = grouped_row_sums(dh, routing) if need_b1 else None
        dhd, dhs, dhtd, dhts = quantize_buffers(dh, cfg.grad, True, need_w1)
        # each operand dropped once dead, before the next large output is allocated: dh's
        # bf16 rows before dW1 (a parameter's size), its columnwise copy before W1.T
        del dh
        dw1 = None
        if need_w1:
            dw1 = grouped_mm_weights(dhtd.view(g), dhts, xtd.view(act), xts, routing, w1.dtype)
            dw1 = dw1.transpose(1, 2).contiguous() if transposed else dw1
        del dhtd, dhts
        dhidden = None
        if need_x:
            w1td, w1ts = expert_weight_buffers(w1, cfg.weight, transposed, False)
            dx = grouped_mm_rows(dhd.view(g), dhs, w1td, w1ts, routing, ctx.x_dtype)
            pairs = ep.send_back(dx, plan)
            dhidden = pairs.view(plan.tokens, plan.top_k, pairs.shape[-1]).sum(1)
        return dhidden, dw1, db1, dw2, db2, None


def _communicator(comm) -> Communicator:
    """An fp8blk Communicator as given; a torch ProcessGroup (or None: the default group) as
    a TorchComm over it."""
    if isinstance(comm, Communicator):
        return comm
    return TorchComm(comm)


def _layout_key(module):
    """What every rank's copy of an experts module must agree on."""
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters(
        recurse=False)]
    return (module.num_experts, module.has_gate, module.has_bias, module.is_transposed,
            repr(module.fp8blk_config), shapes)


def expert_parallel(model: torch.nn.Module, comm=None, *, fp8_dispatch: bool = True,
                    module_filter_fn=None) -> list:
    """Spread the experts of every fp8blk experts module of ``model`` (converted by
    ``convert_to_float8_block(..., experts=True)`` or ``convert_experts``) over the ranks of
    ``comm``, in place; returns the modules' names.

    ``comm``: an fp8blk Communicator (``TorchComm(group)``, ``MPIComm``, ``NCCLComm``) or a
    ``torch.distributed`` ProcessGroup (None: the default group). Each rank keeps experts
    ``[rank*E/P, (rank+1)*E/P)`` of each 3-D parameter (E a multiple of the rank count P);
    the parameters' names are unchanged, their first dimension is E/P. ``fp8_dispatch``:
    tokens travel as FP8 rows with 1x128 scales (False: in the model dtype, every byte the
    single-rank path's). ``module_filter_fn(module, fqn) -> bool`` chooses modules. Every rank
    of ``comm`` calls this with the same model: ranks whose modules differ (experts, widths,
    layout, dtype, recipe) raise on every rank. Call it before ``fully_shard``."""
    comm = _communicator(comm)
    found = [(fqn, m) for fqn, m in model.named_modules()
             if is_experts_module(m) and m.__dict__.get("fp8blk_config") is not None
             and (module_filter_fn is None or module_filter_fn(m, fqn))]
    problem = None
    if not found:
        problem = ("expert_parallel: no fp8blk experts module in the model (convert it first: "
                   "convert_to_float8_block(model, experts=True))")
    for fqn, m in found:
        if m.__dict__.get("fp8blk_ep") is not None:
            problem = f"expert_parallel: {fqn!r} is expert-parallel already"
        elif m.num_experts % comm.size:
            problem = (f"expert_parallel: {fqn!r} has {m.num_experts} experts, not a multiple "
                       f"of the {comm.size} ranks")
        elif any(type(p) is not torch.nn.Parameter for p in m.parameters(recurse=False)):
            problem = (f"expert_parallel: {fqn!r} holds sharded (DTensor) parameters: call "
                       f"expert_parallel before fully_shard")
    key = fingerprint([(fqn, _layout_key(m)) for fqn, m in found])
    table = comm.meta_all_gather(np.array([key, problem is not None], dtype=np.int64))
    if problem is not None:
        raise ValueError(problem)
    if table[:, 1].any():
        raise ValueError(f"expert_parallel: rank(s) {np.flatnonzero(table[:, 1]).tolist()} "
                         f"raised (see their error); every rank stops here")
    if (table[:, 0] != table[0, 0]).any():
        raise ValueError("expert_parallel: the ranks' models differ in their experts modules "
                         "(names, expert count, widths, layout, dtype or recipe)")
    for _, m in found:
        ep = ExpertParallel(comm, m.num_experts, fp8_dispatch)
        keep = slice(ep.first, ep.first + ep.local)
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 1 and p.shape[0] == m.num_experts:
                setattr(m, name, torch.nn.Parameter(p.detach()[keep].clone(),
                                                    requires_grad=p.requires_grad))
        m.fp8blk_ep = ep
    return [fqn for fqn, _ in found]


__all__ = ["expert_parallel", "ExpertParallel", "Plan"]
