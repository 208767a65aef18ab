"""Tensor + sequence parallelism with FP8 linears and the FP8 input all-gather, against one rank.

    torchrun --standalone --nproc-per-node=2 examples/tensor_parallel.py            # CPU: gloo
    torchrun --standalone --nproc-per-node=2 examples/tensor_parallel.py --large    # 2 GPUs

A Llama-style feed-forward block ``out_proj(silu(w1(x)) * w2(x))`` is converted with
``fp8blk.torch.convert_to_float8_block`` and split over the ranks (Megatron-style sequence
parallelism, sequence-first activations (S, B, D), each rank holding S/tp of the sequence):

* w1, w2: ``Float8BlockColwiseSequenceParallel``: the rank's input shard is quantized to FP8
  (1x128 rowwise blocks for the forward GEMM, 128x1 columnwise for the weight gradient) and
  all-gathered in FP8 with ``fb.comm.gather_along_first_dim``; each rank holds hidden/tp rows
  of the weights.
* out_proj: ``Float8BlockRowwiseSequenceParallel``: partial outputs reduce-scattered back to
  the sequence shard; in the backward pass the output gradient is all-gathered in FP8.

The same block, unsharded, runs the whole sequence on every rank (the reference). Checks
(exit 1 on failure), all from the FP8 GEMMs' own arithmetic:

* weight gradients of all three layers: bit-equal to the reference's (each is computed from the
  same FP8 values by the same reduction over all tokens);
* the output and the input gradient: these are sums of the ranks' partial sums, which differ
  from the reference's single sum only in summation order. For a product C = A B^T with an
  fp32 reduction over K, two orders differ by at most 2 gamma_K sum_k |A_ik| |B_jk| with
  gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability of Numerical
  Algorithms, 3.1); |FP8(a)| <= (1 + 2^-4) |a| + 2^-16 amax for E4M3 with power-of-two scales
  (relative rounding 2^-4; subnormal step 2^-9 of scale_inv < 2 amax / 448), so the check
  uses that bound on the unquantized operands, in norm;
* the gathers took the FP8 path (not the high-precision fallback) and sent the bytes counted
  in ``comm.stats``: printed against what bf16 gathers of the same activations would send.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

U = 2.0 ** -24  # fp32 unit roundoff


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512, help="hidden/tp: a multiple of 128")
    p.add_argument("--seq", type=int, default=256, help="sequence length S (S/tp x batch: "
                   "a multiple of 128 keeps the FP8 gather on its fast path)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed forward+backward passes")
    p.add_argument("--large", action="store_true",
                   help="GPU sizes: D=4096, hidden=14336, S=4096, batch 2, bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.large:
        args.d_model, args.hidden, args.seq, args.batch = 4096, 14336, 4096, 2
    return args


class FeedForward(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden)
        self.w2 = nn.Linear(d, hidden)
        self.out_proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.out_proj(F.silu(self.w1(x)) * self.w2(x))


def spread(shape, gen, scale=1.0):
    """Values whose rows span orders of magnitude (what block scales are for)."""
    x = torch.randn(shape, generator=gen)
    return x * torch.exp(torch.empty(shape[:-1] + (1,)).uniform_(-2, 2, generator=gen)) * scale


def fp8_magnitude(a):
    """An upper bound of |FP8(a)| elementwise (module docstring), in float64."""
    a = a.detach().double().abs()
    return (1 + 2.0 ** -4) * a + 2.0 ** -16 * a.max()


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    ok = run(args, cuda)
    # The run's models, mesh and comm (and any reference cycles among them) are freed before
    # the groups are torn down, and every rank is done with its collectives: a process group
    # still alive at interpreter exit dies during finalization, where gloo's teardown can
    # abort ("terminate called without an active exception" after PASSED)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def run(args, cuda):
    """Build, run and check the TP + SP model on this rank; True if every rank's checks pass."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8blk.torch import convert_to_float8_block
    from fp8blk.torch.tensor_parallel import (Float8BlockColwiseSequenceParallel,
                                              Float8BlockRowwiseSequenceParallel, comm_for)

    say = print if rank == 0 else (lambda *a, **k: None)
    D, H, S, B = args.d_model, args.hidden, args.seq, args.batch
    if S % world or H % world:
        raise SystemExit(f"--seq ({S}) and --hidden ({H}) must be multiples of the world size")
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU bf16 matmuls are slow
    gen = torch.Generator().manual_seed(args.seed)
    ref = FeedForward(D, H)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(spread(p.shape if p.dim() > 1 else (1, p.shape[0]), gen,
                           p.shape[-1] ** -0.5).reshape(p.shape))
    ref = ref.to(device=device, dtype=dtype)
    convert_to_float8_block(ref)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh(device.type, (world,))
    parallelize_module(model, mesh, {"w1": Float8BlockColwiseSequenceParallel(),
                                     "w2": Float8BlockColwiseSequenceParallel(),
                                     "out_proj": Float8BlockRowwiseSequenceParallel()})
    comm = comm_for(mesh)

    x = spread((S, B, D), gen).to(device=device, dtype=dtype)   # the same on every rank
    g = spread((S, B, D), gen).to(device=device, dtype=dtype)   # dL/dy
    rows = slice(rank * S // world, (rank + 1) * S // world)
    say(f"TP + SP on {world} ranks ({'NCCL, GPUs' if cuda else 'gloo, CPU'}), {dtype}: "
        f"FeedForward {D}->{H}->{D}, sequence {S} x batch {B}, {S // world} positions per rank")

    # the reference: everything on one rank; out_proj's input and w1/w2's output gradients are
    # kept for the summation-order bounds
    saved = {}
    ref.out_proj.register_forward_hook(lambda m, inp, out: saved.__setitem__("h", inp[0]))
    for name in ("w1", "w2"):
        getattr(ref, name).register_full_backward_hook(
            lambda m, gin, gout, name=name: saved.__setitem__(name, gout[0]))
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr)
    y_ref.backward(g)
    saved = {k: v.detach() for k, v in saved.items()}

    times = []
    for step in range(args.steps + 1):
        for p in model.parameters():
            p.grad = None
        comm.reset_stats()
        x_local = x[rows].clone().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        y = model(x_local)
        y.backward(g[rows])
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if step:  # step 0 compiles kernels and allocates
            times.append(time.perf_counter() - t0)
    stats = comm.stats

    # u_out: rounding of a GEMM output, a partial sum, a reduce-scatter or a bias add to the
    # model dtype (fp32 on the CPU, bf16 on GPUs)
    u_out = U if dtype == torch.float32 else 2.0 ** -8
    checks, details = {}, {}

    def compare(name, got, want, a, b, k, exact_expected):
        """got vs want, C = a @ b.T reduced over k in two orders: elementwise the difference is
        at most (2 gamma_k + 4 u_out) (|FP8(a)| |FP8(b)|^T): 2 gamma_k for the two fp32
        reductions, 3 u_out for rounding the reference's result, each of the partial sums and
        their sum (4 u_out covers the (1 + gamma) factors); hence the same bound in norm."""
        diff = float(torch.linalg.norm(got.double() - want.double()))
        gamma = k * U / (1 - k * U)
        bound = float((2 * gamma + 4 * u_out)
                      * torch.linalg.norm(fp8_magnitude(a) @ fp8_magnitude(b).T))
        exact = torch.equal(got, want)
        checks[name] = diff <= bound and (exact or not exact_expected)
        # relative to |want|: an error at FP8's rounding level would be ~1e-2, far above
        norm = float(torch.linalg.norm(want.double())) or 1.0
        details[name] = ("bit-equal" if exact else
                         f"|diff|/|ref| {diff / norm:.1e} <= bound {bound / norm:.1e}")

    tokens = S * B
    h, dh1, dh2 = (saved[n].reshape(tokens, -1) for n in ("h", "w1", "w2"))
    x2, g2 = x.reshape(tokens, D), g.reshape(tokens, D)
    y_all = torch.cat(_all_gather(y.detach()), dim=0)
    compare("output", y_all.reshape(tokens, D), y_ref.detach().reshape(tokens, D), h,
            ref.out_proj.weight, H, False)
    dx_all = torch.cat(_all_gather(x_local.grad), dim=0)
    # dx = dh1 W1 + dh2 W2, each reduced over the hidden dim split across the ranks; the sum of
    # the two is bounded by the sum of the bounds (plus its rounding, inside 4 u_out): pass
    # the two products as one of reduction length 2H
    compare("input gradient", dx_all.reshape(tokens, D), xr.grad.reshape(tokens, D),
            torch.cat([dh1, dh2], dim=1), torch.cat([ref.w1.weight.T, ref.w2.weight.T], dim=1),
            2 * H, False)
    # weight gradients dY^T X over all tokens: the same FP8 values reduced over the same tokens
    # (bit-equal on the CPU; cuBLAS may pick another reduction order for a shard's shape)
    for name, dy_, x_ in (("w1", dh1, x2), ("w2", dh2, x2), ("out_proj", g2, h)):
        layer, ref_layer = getattr(model, name), getattr(ref, name)
        full = layer.weight.grad.full_tensor()
        compare(f"{name}.weight gradient", full, ref_layer.weight.grad, dy_.T, x_.T, tokens,
                not cuda)
        full_b = layer.bias.grad
        full_b = full_b.full_tensor() if isinstance(full_b, DTensor) else full_b
        ones = torch.ones(1, tokens, dtype=dtype, device=device)
        compare(f"{name}.bias gradient", full_b[None], ref_layer.bias.grad[None], ones, dy_.T,
                tokens, False)
    paths = dict(stats.gather_paths)
    checks["FP8 gathers took the fast path"] = set(paths) == {"fast"}
    details["FP8 gathers took the fast path"] = str(paths)

    # without FP8, each of these gathers would move the same activations in bf16 (2 bytes an
    # element); fp8blk's gathers carry rowwise AND columnwise FP8 bytes (forward GEMM and
    # weight gradient) plus scales, so they move about as much as bf16, and quantize nothing
    # twice
    gathers, fp8_bytes = stats.ops.get("all_gather_v", [0, 0])
    bf16_bytes = 2 * (S // world) * B * D * gathers
    step_s = sum(times) / max(len(times), 1)
    say(f"forward+backward {1e3 * step_s:.1f} ms ({S * B / step_s:,.0f} tokens/s)")
    say(f"per pass, rank {rank}: " + ", ".join(f"{op} {n}x {b:,} bytes"
                                               for op, (n, b) in stats.ops.items()))
    say(f"  the {gathers} FP8 all-gathers sent {fp8_bytes:,} bytes; bf16 gathers of the same "
        f"activations: {bf16_bytes:,}. Each FP8 gather carries two 1-byte copies (rowwise for "
        f"the forward GEMM, columnwise for the weight gradient) plus their scales: "
        f"{2 * fp8_bytes / max(bf16_bytes, 1):.3f} bytes an element against bf16's 2")
    results = _all_gather_objects(checks)
    ok = all(all(r.values()) for r in results)
    for what in checks:
        say(f"  {'ok  ' if all(r[what] for r in results) else 'FAIL'} {what:<32}"
            f"{details[what]}")
    say("checks: " + ("PASSED" if ok else "FAILED"))
    return ok


def _all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _all_gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    sys.exit(main())
