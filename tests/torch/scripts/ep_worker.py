"""Expert-parallel checks on 4 gloo ranks (tests/torch/moe/test_parallel.py launches them; torchrun
works too). Every rank prints ``SUITE OK`` at the end; any failed check raises.

Groups: the 4 ranks (P=4), the pairs {0, 1} and {2, 3} (P=2), and each rank alone (P=1).
Every rank makes the inputs of every rank of its group (seeded by rank), so it can run the
single-rank references itself.

* experts modules (tiny Qwen3-MoE, Mixtral, gpt-oss: SiLU gating, an intermediate width that is
  not a multiple of 128, transposed weights with biases and a clamped gate), routing balanced,
  skewed (a quarter of the experts empty) and with a rank that has no token, at P=4 (and P=2
  for Qwen3-MoE):
  - ``fp8_dispatch=False``: output, input gradient, router-weight gradient and the local
    experts' weight and bias gradients equal the single-rank converted module's on every
    rank's tokens together, byte for byte (each expert sees the same rows in the same order:
    source rank, then token);
  - ``fp8_dispatch=True``: the same against the module made expert-parallel on one rank (the
    same FP8 math), but the down projection's bias gradient, whose fp32 partial sums depend
    on the group's size (within that order's bound and one bf16 rounding); against the
    single-rank module without the FP8 dispatch, output and input/router gradients byte for
    byte, the weight gradients within FP8's rounding (their 128x1 operands are made from the
    FP8 rows: printed, bounded below);
* a tiny Qwen3-MoE model at P=4: logits, loss and the experts' gradients against the
  single-rank model on the four ranks' sequences (fp8 and bf16 dispatch), and with activation
  checkpointing against without;
* EP x FSDP2 on a 2x2 mesh (dim "ep": the pairs; "dp": {0, 2}, {1, 3}): one SGD step of the
  tiny Qwen3-MoE against the single-rank references (see ``check_ep_fsdp``);
* bad input, every rank raising and the group going on: models that differ between ranks, an
  expert count that is not a multiple of the ranks, an expert id out of range on one rank, a
  hidden size or dtype that differs on one rank.
"""
import copy
import datetime
import functools
import os
import time
import zlib

import torch
import torch.distributed as dist

from fp8blk.comm import TorchComm
from fp8blk.torch.moe import convert_experts, expert_parallel
from tests.torch.moe._reference import experts_module, routing_ids, tiny_model

SEED = int(os.environ.get("FP8BLK_SEED", "0"))
H_DTYPE = torch.bfloat16
SINGLES = []   # each rank's one-rank group
# (arch, routings): every routing on Qwen3-MoE; Mixtral (intermediate 192) and gpt-oss
# (transposed, biases, clamped gate) on the routings that reach their own code paths
EXPERT_CASES = (("qwen3_moe", ("balanced", "skewed", "no_tokens")), ("mixtral", ("skewed",)),
                ("gpt_oss", ("balanced", "no_tokens")))
PAIR_ARCHS = ("qwen3_moe",)     # the archs also checked at P=2


def seed_of(*key):
    """A seed from ``key``, the same in every process (unlike hash() of strings)."""
    return zlib.crc32(repr((SEED,) + key).encode()) & 0x7FFFFFFF


def gen(*key):
    return torch.Generator().manual_seed(seed_of(*key))


def inputs(rank, case, module, hidden_size, kind):
    """One rank's (hidden, top_k_index, top_k_weights, output gradient) for a case."""
    tokens = 0 if (kind == "no_tokens" and rank % 2 == 1) else 100 + 40 * rank
    k = 2
    g = gen(rank, case)
    spread = 10.0 ** (torch.rand(1, hidden_size, generator=g) * 4 - 2)
    hidden = (torch.randn(tokens, hidden_size, generator=g) * spread).to(H_DTYPE)
    idx = routing_ids(tokens, k, module.num_experts, "skewed" if kind == "skewed"
                      else "balanced", seed=seed_of(rank, case, "routing"))
    weights = torch.rand(tokens, k, generator=g).to(H_DTYPE)
    dout = torch.randn(tokens, hidden_size, generator=g).to(H_DTYPE)
    return hidden, idx, weights, dout


def run(module, hidden, idx, weights, dout):
    """(output, d hidden, d weights, {param name: grad}) of one forward and backward."""
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = module(hidden, idx, weights)
    out.backward(dout)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return out.detach(), hidden.grad, weights.grad, grads


def equal(a, b, what):
    if a.shape != b.shape or not torch.equal(a, b):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: differs (max |diff| {diff}, shapes {tuple(a.shape)} "
                             f"{tuple(b.shape)})")


def within_sum_order(a, b, together, experts, what):
    """a, b (E/P, N) bf16: the down projection's bias gradient, each a bf16 rounding of an fp32
    sum of the same rows (w * dY of each pair routed to the expert) in another order. Two fp32
    sums of n terms differ by at most 2 (n - 1) 2^-24 sum|x| (recursive summation's bound;
    n = the expert's pairs plus one partial per rank, each |x| <= |w| |dY| (1 + 2^-8) after the
    row's bf16 rounding), and each rounding to bf16 moves a value by at most 2^-8 of it."""
    _, idx, weights, dout = together
    w, d = weights.float().abs(), dout.float().abs()
    for i, e in enumerate(experts):
        mine = idx == e
        n = int(mine.sum()) + dist.get_world_size()
        abs_sum = ((mine * w).sum(1, keepdim=True) * d).sum(0) * (1 + 2.0 ** -8)
        x, y = a[i].float(), b[i].float()
        tol = 2 * (n - 1) * 2.0 ** -24 * abs_sum + 2.0 ** -8 * (x.abs() + y.abs())
        if not ((x - y).abs() <= tol).all():
            raise AssertionError(f"{what}: expert {e} beyond fp32's summation order and one "
                                 f"bf16 rounding each (max |diff| {(x - y).abs().max()})")


@functools.lru_cache(maxsize=None)
def _converted(arch):
    model = tiny_model(arch, dtype=H_DTYPE, seed=SEED % 1000)
    convert_experts(model)
    return experts_module(model)


def converted_experts(arch):
    """A fresh copy of the tiny model's first converted experts module."""
    return copy.deepcopy(_converted(arch))


def check_experts(arch, comm, members, single, kind, fp8):
    """One experts case at the group ``members`` (global ranks, this rank among them)."""
    base = converted_experts(arch)
    case = (arch, len(members), kind, fp8)
    width = base.down_proj.shape[2] if base.is_transposed else base.down_proj.shape[1]
    every = [inputs(r, case, base, width, kind) for r in members]
    mine = members.index(dist.get_rank())
    lo = sum(x[0].shape[0] for x in every[:mine])
    hi = lo + every[mine][0].shape[0]
    together = [torch.cat([x[i] for x in every]) for i in range(4)]

    ep = copy.deepcopy(base)
    expert_parallel(ep, comm, fp8_dispatch=fp8)
    got = run(ep, *every[mine])
    local = ep.fp8blk_ep
    keep = slice(local.first, local.first + local.local)
    ref = run(base, *together)
    what = f"{arch} P={len(members)} {kind} fp8={fp8}"
    for i, name in ((0, "output"), (1, "d hidden"), (2, "d top_k_weights")):
        equal(got[i], ref[i][lo:hi], f"{what}: {name} vs the single-rank module")
    if not fp8:
        for n, g in got[3].items():
            equal(g, ref[3][n][keep], f"{what}: d {n} vs the single-rank module")
        return
    alone = copy.deepcopy(base)
    expert_parallel(alone, single, fp8_dispatch=True)
    ref1 = run(alone, *together)
    for i, name in ((0, "output"), (1, "d hidden"), (2, "d top_k_weights")):
        equal(got[i], ref1[i][lo:hi], f"{what}: {name} vs EP on one rank")
    experts = range(local.first, local.first + local.local)
    for n, g in got[3].items():
        if n == "down_proj_bias":
            # partial sums where the tokens live, added on the expert's rank: the order of the
            # fp32 sum depends on the group's size, so not byte for byte even at P=1
            within_sum_order(g, ref1[3][n][keep], together, experts, f"{what}: d {n} vs EP "
                             f"on one rank")
        else:
            equal(g, ref1[3][n][keep], f"{what}: d {n} vs EP on one rank")
        # against the single-rank module: the weight gradients' 128x1 operands differ by one
        # FP8 rounding of the FP8 rows (relative 2^-4 per element, twice) against one of the
        # high-precision rows: a difference within 2^-2 of the gradient's scale
        r = ref[3][n][keep].float()
        diff = (g.float() - r).norm() / r.norm().clamp_min(1e-30)
        if n == "down_proj_bias":
            within_sum_order(g, ref[3][n][keep], together, experts,
                             f"{what}: d {n} vs the single-rank module")
        elif n.endswith("_bias"):
            step = 2.0 ** -7 * r.abs().clamp_min(2.0 ** -126)
            if not ((g.float() - r).abs() <= step).all():
                raise AssertionError(f"{what}: d {n} more than one bf16 step from the "
                                     f"single-rank module's")
        elif not diff <= 0.25:
            raise AssertionError(f"{what}: d {n} vs the single-rank module: relative "
                                 f"Frobenius difference {diff:.3g} > 2^-2")
        print(f"rank {dist.get_rank()} {what}: d {n} relative difference to the exact "
              f"columnwise path {diff:.2e}")


def tokens_of(rank, case, vocab, length=64):
    return torch.randint(0, vocab, (1, length), generator=gen(rank, case, "ids"))


def model_pass(model, ids, scale=1.0):
    """(logits, loss) of a causal-LM pass on ``ids`` (1, S) or (B, S): the loss per sequence
    (each rank's mean over its own tokens), their sum times ``scale`` backpropagated."""
    out = model(input_ids=ids)
    logits = out.logits
    losses = torch.stack([torch.nn.functional.cross_entropy(
        logits[b, :-1].float(), ids[b, 1:]) for b in range(ids.shape[0])])
    (losses.sum() * scale).backward()
    return logits.detach(), losses.detach()


def check_model(comm, single, fp8):
    """The tiny Qwen3-MoE (every Linear and the experts converted) at P=4: each rank's
    sequence against the single-rank model on the four sequences: logits and losses byte for
    byte, the local experts' gradients byte for byte (``fp8_dispatch=False``; with the FP8
    dispatch against the model made expert-parallel on one rank), the other parameters'
    gradients summed over the ranks within fp32 summation order (``dense_bound``); and the
    expert-parallel model with activation checkpointing equal to it without."""
    from fp8blk.torch import convert_to_float8_block
    rank = dist.get_rank()
    base = tiny_model("qwen3_moe", dtype=torch.float32, seed=SEED % 1000)
    convert_to_float8_block(base, experts=True)
    case = ("model", fp8)
    every = [tokens_of(r, case, base.config.vocab_size) for r in range(4)]
    ep = copy.deepcopy(base)
    expert_parallel(ep, comm, fp8_dispatch=fp8)
    recomputed = copy.deepcopy(ep)
    recomputed.gradient_checkpointing_enable()
    recomputed.train()
    logits, loss = model_pass(ep, every[rank])
    # activation checkpointing: the forward (collectives included) recomputed in the
    # backward pass, every rank in the same order: the same bytes
    model_pass(recomputed, every[rank])
    for (name, p), q in zip(ep.named_parameters(), recomputed.parameters()):
        equal(q.grad, p.grad, f"model fp8={fp8}: d {name} with activation checkpointing")
    ref_model = base
    if fp8:
        ref_model = copy.deepcopy(base)
        expert_parallel(ref_model, single, fp8_dispatch=True)
    ref_logits, ref_losses = model_pass(ref_model, torch.cat(every))
    equal(logits[0], ref_logits[rank], f"model fp8={fp8}: logits")
    equal(loss, ref_losses[rank:rank + 1], f"model fp8={fp8}: loss")
    ref_params = dict(ref_model.named_parameters())
    for name, p in ep.named_parameters():
        ref = ref_params[name].grad
        holder = ep.get_submodule(name.rsplit(".", 1)[0])
        local = holder.__dict__.get("fp8blk_ep")
        if local is not None:
            equal(p.grad, ref[local.first:local.first + local.local],
                  f"model fp8={fp8}: d {name}")
            continue
        dense_bound(p.grad, ref, f"model fp8={fp8}: d {name}")


def dense_bound(grad, ref, what):
    """A replicated parameter's gradient: this rank's, summed over the ranks (fp32), against
    the single-rank model's over every rank's tokens. The same per-token terms summed in
    another order: |diff| <= n * 2^-24 * sum|terms| for n terms; with n <= 256 tokens that is
    2^-16 of the terms' absolute sum, checked as 2^-12 of the ranks' summed |gradients|
    (which the terms' absolute sum bounds from below: the margin covers it)."""
    total = grad.detach().float().clone()
    mag = total.abs()
    dist.all_reduce(total)
    dist.all_reduce(mag)
    diff = (total - ref.float()).abs()
    tol = 2.0 ** -12 * (mag + ref.float().abs()) + 2.0 ** -60
    if not (diff <= tol).all():
        raise AssertionError(f"{what}: off by {diff.max().item():.3g} (bound "
                             f"{tol.flatten()[diff.argmax()].item():.3g})")


LR = 2.0 ** -4


def check_ep_fsdp(mesh, flat, fp8):
    """One SGD step of the tiny Qwen3-MoE (fp32 parameters, every Linear and the experts
    converted, dense weights gathered in FP8: ``prepare_fsdp_fp8`` "cast") with the experts
    spread over mesh dim "ep" and sharded by FSDP2 over "dp", the rest sharded by FSDP2 over
    all four ranks. Reference: per "ep" group, the single-rank model (with the FP8 dispatch:
    made expert-parallel on one rank) on the group's two sequences, gradients G_A and G_B.
    FSDP2 averages over its mesh: (G_A + G_B) / 4 for the replicated parameters (the mean of
    the four ranks' loss gradients), (G_A + G_B) / 2 for the experts (each expert's gradient
    already sums its "ep" group's two ranks through the dispatch; on NCCL
    ``set_gradient_divide_factor(4)`` on the experts' FSDP module makes it the mean too, gloo
    has no PREMUL_SUM). Checked: logits and loss byte for byte; the experts' parameters after
    the step byte for byte (two fp32 terms, a power-of-two division: order-free); the others within
    the fp32 summation order of ``dense_bound``, scaled by the learning rate (a power of two:
    the update rounds once)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fp8blk.torch import convert_to_float8_block
    from fp8blk.torch.fsdp import prepare_fsdp_fp8
    rank = dist.get_rank()
    base = tiny_model("qwen3_moe", dtype=torch.float32, seed=SEED % 1000)
    convert_to_float8_block(base, experts=True)
    case = ("ep_fsdp", fp8)
    every = [tokens_of(r, case, base.config.vocab_size) for r in range(4)]
    refs = []
    for g in (0, 1):
        ref = copy.deepcopy(base)
        if fp8:
            expert_parallel(ref, TorchComm(SINGLES[rank]), fp8_dispatch=True)
        refs.append((ref, *model_pass(ref, torch.cat(every[2 * g:2 * g + 2]))))
    model = copy.deepcopy(base)
    expert_parallel(model, TorchComm(mesh["ep"].get_group()), fp8_dispatch=fp8)
    prepare_fsdp_fp8(model, mode="cast", model_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh["dp"])
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logits, loss = model_pass(model, every[rank])
    opt.step()
    mine = refs[rank // 2]
    equal(logits[0], mine[1][rank % 2], f"EP x FSDP2 fp8={fp8}: logits")
    equal(loss, mine[2][rank % 2:rank % 2 + 1], f"EP x FSDP2 fp8={fp8}: loss")
    params = [dict(r[0].named_parameters()) for r in refs]
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        start = base.get_parameter(name).detach()
        g0, g1 = params[0][name].grad.float(), params[1][name].grad.float()
        holder = model.get_submodule(name.rsplit(".", 1)[0])
        local = holder.__dict__.get("fp8blk_ep")
        if local is not None:
            keep = slice(local.first, local.first + local.local)
            want = start[keep] - LR * ((g0[keep] + g1[keep]) / 2)
            equal(full, want, f"EP x FSDP2 fp8={fp8}: {name} after the step")
            continue
        want = start - LR * ((g0 + g1) / 4)
        tol = LR * 2.0 ** -12 * (g0.abs() + g1.abs()) / 4 + 2.0 ** -23 * start.abs()
        diff = (full - want).abs()
        if not (diff <= tol + 2.0 ** -60).all():
            raise AssertionError(f"EP x FSDP2 fp8={fp8}: {name} after the step off by "
                                 f"{diff.max().item():.3g}")


def raises_everywhere(name, fn):
    """``fn`` must raise a ValueError or TypeError on this rank (every rank runs this); prints
    ``bad NAME raised TYPE`` for the launcher to count."""
    try:
        fn()
    except (ValueError, TypeError) as err:
        print(f"bad {name} raised {type(err).__name__}: {err}")
        return
    raise AssertionError(f"bad input {name!r}: no error on rank {dist.get_rank()}")


def check_bad_inputs(comm):
    """Each bad input raises on every rank, and the group goes on (the last call works)."""
    import transformers
    rank, last = comm.rank, comm.size - 1      # ranks within the group

    def differing_models():
        model = tiny_model("qwen3_moe", dtype=H_DTYPE, seed=0)
        if rank == 0:
            cfg = model.config
            cfg.moe_intermediate_size = 256
            model = transformers.Qwen3MoeForCausalLM(cfg).to(H_DTYPE)
        convert_experts(model)
        expert_parallel(model, comm)

    def uneven_experts():
        model = tiny_model("qwen3_moe", dtype=H_DTYPE, seed=0)
        cfg = model.config
        cfg.num_experts = 2 * comm.size + 1
        model = transformers.Qwen3MoeForCausalLM(cfg).to(H_DTYPE)
        convert_experts(model)
        expert_parallel(model, comm)

    def unconverted():
        expert_parallel(tiny_model("qwen3_moe", dtype=H_DTYPE, seed=0), comm)

    raises_everywhere("differing_models", differing_models)
    raises_everywhere("uneven_experts", uneven_experts)
    raises_everywhere("unconverted", unconverted)
    module = converted_experts("qwen3_moe")
    expert_parallel(module, comm)
    hidden, idx, weights, _ = inputs(dist.get_rank(), ("bad",), module, 256, "balanced")

    def call(h=hidden, i=idx):
        module(h, i, weights)

    bad_idx = idx.clone()
    if rank == last:
        bad_idx[3, 0] = 99
    raises_everywhere("expert_id", lambda: call(i=bad_idx))
    raises_everywhere("hidden_size", lambda: call(h=hidden[:, :128] if rank == 0 else hidden))
    raises_everywhere("dtype", lambda: call(h=hidden.float() if rank == last else hidden))
    call()      # the group goes on


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "the EP worker runs on 4 ranks"
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    SINGLES[:] = [dist.new_group([r]) for r in range(world)]
    world_comm = TorchComm()
    pair_comm = TorchComm(pairs[rank // 2])
    single = TorchComm(SINGLES[rank])
    pair = [2 * (rank // 2), 2 * (rank // 2) + 1]
    t0 = time.perf_counter()
    for arch, kinds in EXPERT_CASES:
        for kind in kinds:
            for fp8 in (False, True):
                check_experts(arch, world_comm, [0, 1, 2, 3], single, kind, fp8)
                if arch in PAIR_ARCHS:
                    check_experts(arch, pair_comm, pair, single, kind, fp8)
    print(f"rank {rank} experts cases passed ({time.perf_counter() - t0:.1f} s)")
    for fp8 in (False, True):
        check_model(world_comm, single, fp8)
    print(f"rank {rank} model cases passed ({time.perf_counter() - t0:.1f} s)")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    for fp8 in (False, True):
        check_ep_fsdp(mesh, flat, fp8)
    print(f"rank {rank} EP x FSDP2 cases passed ({time.perf_counter() - t0:.1f} s)")
    check_bad_inputs(world_comm)
    check_bad_inputs(pair_comm)
    print(f"rank {rank} bad-input cases passed ({time.perf_counter() - t0:.1f} s)")
    dist.barrier()
    dist.destroy_process_group()
    print(f"SUITE OK rank {rank}")


if __name__ == "__main__":
    main()
