"""GPU checks of fp8blk's experts path (fp8blk/torch/moe): the operands' bytes per expert equal
fb.quantize of each expert's rows alone, each expert's GEMM outputs equal blockwise_scaled_mm
on those operands and the dense float8_block_linear on its segment, at balanced, skewed
(empty and >128-row experts) and tiny routings; a tiny Qwen3-MoE and gpt-oss on CUDA against
the per-expert dense loop (within the bound of a reordered fp32 sum: the loop's GEMMs run on
unpadded row counts, for which cuBLASLt may choose another algorithm); a converted block
captured in a CUDA graph, replayed equal to eager; the first projection keeping the tokens
(``keep_input``) equal to the block without it."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fp8blk.kernels import grouped_gemm
from fp8blk.torch import Float8BlockConfig, blockwise_scaled_mm, float8_block_linear
from fp8blk.torch.linear.functional import quantize_buffers
from fp8blk.torch.moe import convert_experts, grouped_linear, permute, route

from ._reference import (captured, combine_against_index, routing_ids, tiny_model,
                         traced_combine_node)

pytestmark = pytest.mark.gpu


@pytest.fixture
def loops_only():
    """The per-expert loops, the one-launch kernels off (tests/kernels/test_grouped_gemm_gpu.py
    holds the kernels to these loops' bytes)."""
    prev = grouped_gemm.set_policy("never")
    yield
    grouped_gemm.set_policy(prev)


def _skewed_rows(tokens, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)) * 10.0 ** rng.integers(-3, 4, (tokens, 1))
    return torch.from_numpy((x * 10.0 ** rng.integers(-2, 3, (1, k))).astype(np.float32))


@pytest.mark.parametrize("kind,tokens,experts,top_k,k,n", [
    ("balanced", 1000, 8, 2, 512, 768), ("skewed", 1000, 8, 2, 512, 768),
    ("tiny", 9, 16, 4, 256, 384), ("skewed", 700, 6, 3, 640, 200)])
def test_grouped_linear_bytes(kind, tokens, experts, top_k, k, n, loops_only):
    idx = routing_ids(tokens, top_k, experts, kind, seed=5, device="cuda")
    r = route(idx, experts)
    h = _skewed_rows(tokens, k, 1).to("cuda", torch.bfloat16)
    x = permute(h, r).requires_grad_()
    w = (torch.randn(experts, n, k, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    y = grouped_linear(x, w, r)
    dy = (torch.randn_like(y) * r.valid_rows().unsqueeze(-1))
    y.backward(dy)
    cfg = Float8BlockConfig()
    qx = quantize_buffers(x.detach(), cfg.activation, True, True)
    seen_empty = False
    for e, (start, padded, count) in enumerate(r.host()):
        if not padded:
            assert not w.grad[e].any()
            seen_empty = True
            continue
        seg = slice(start, start + padded)
        # operand bytes: each expert's rows quantized alone (from bf16, as the layer does)
        qa = quantize_buffers(x.detach()[start:start + count].contiguous(), cfg.activation,
                              True, True)
        assert torch.equal(qx[0][start:start + count], qa[0])
        assert torch.equal(qx[1][:, start:start + count], qa[1][:, :count])
        blocks = -(-count // 128)
        assert torch.equal(qx[2][:, start:start + count], qa[2])
        assert torch.equal(qx[3][start // 128:start // 128 + blocks], qa[3])
        # outputs: the GEMM on the segment's operands, and the dense layer on the segment
        qw = quantize_buffers(w.detach()[e].contiguous(), cfg.weight, True, False)
        ref = blockwise_scaled_mm(qx[0][seg].view(torch.float8_e4m3fn),
                                  qx[1][:, seg].contiguous(), qw[0].view(torch.float8_e4m3fn),
                                  qw[1], "1x128", "128x128", torch.bfloat16)
        assert torch.equal(ref, y[seg])
        xs = x.detach()[seg].clone().requires_grad_()
        we = w.detach()[e].clone().requires_grad_()
        ys = float8_block_linear(xs, we)
        ys.backward(dy[seg])
        assert torch.equal(ys, y[seg])
        assert torch.equal(xs.grad, x.grad[seg])
        assert torch.equal(we.grad, w.grad[e])
    assert seen_empty or kind != "skewed"


@pytest.mark.parametrize("kind,tokens,experts,top_k", [
    ("balanced", 2048, 64, 8), ("skewed", 1000, 8, 2), ("tiny", 9, 16, 4)])
def test_direct_loops_equal_the_per_expert_calls(kind, tokens, experts, top_k, monkeypatch,
                                                loops_only):
    """The experts' GEMM loops on cuBLASLt directly (addresses into the grouped buffers, one
    gather of the 1x128 scales) give the per-expert blockwise_scaled_mm loop's bytes -- y,
    dx, dW, with empty experts -- and make no per-expert call."""
    from fp8blk.torch.moe import gemms
    idx = routing_ids(tokens, top_k, experts, kind, seed=7, device="cuda")
    r = route(idx, experts)
    h = _skewed_rows(tokens, 512, 2).to("cuda", torch.bfloat16)
    w = (torch.randn(experts, 768, 512, device="cuda") * 0.05).to(torch.bfloat16)
    dy = torch.randn(r.rows, 768, device="cuda", dtype=torch.bfloat16)
    dy = dy * r.valid_rows().unsqueeze(-1)

    def run():
        x = permute(h, r).requires_grad_()
        ww = w.clone().requires_grad_()
        y = grouped_linear(x, ww, r)
        y.backward(dy)
        return y, x.grad, ww.grad
    with monkeypatch.context() as m:
        m.setattr(gemms, "_direct_rows", lambda *a: None)
        m.setattr(gemms, "_direct_weights", lambda *a: None)
        want = run()

    def boom(*a, **k):
        raise AssertionError("a per-expert blockwise_scaled_mm call")
    monkeypatch.setattr(gemms, "blockwise_scaled_mm", boom)
    got = run()
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        assert torch.equal(a, b), (kind, name)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_tiny_model_equals_the_loop(name):
    from .test_experts import LOOP, _close_bf16
    model = tiny_model(name, device="cuda")
    loop = copy.deepcopy(model)
    loop.config._experts_implementation = LOOP
    convert_experts(model)
    ids = torch.randint(0, 256, (2, 160), generator=torch.Generator().manual_seed(0)).cuda()
    outs = []
    for m in (model, loop):
        out = m(ids, labels=ids)
        out.loss.backward()
        outs.append((out.loss, {n: p.grad for n, p in m.named_parameters()}))
    assert _close_bf16(outs[0][0], outs[1][0])
    for n, g in outs[0][1].items():
        assert _close_bf16(g, outs[1][1][n]), n


def _run_block(fn, block, x, g):
    """[y, dx, every parameter's gradient] of ``fn`` (``block`` or its compiled form) on a
    copy of x, backward from g; the block's gradients reset after."""
    xx = x.clone().requires_grad_()
    y = fn(xx)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(g)
    out = [y, xx.grad] + [p.grad.clone() for p in block.parameters()]
    for p in block.parameters():
        p.grad = None
    return out


@pytest.mark.parametrize("experts", [4, 128])
def test_block_with_kernels_equals_torch_ops(monkeypatch, experts):
    """A converted Qwen3-MoE block forward and backward on the one-pass gate and combine
    kernels (fp8blk.kernels.silu_gate, weighted_rows) byte-equal to the same block on torch's
    ops (FP8BLK_GATE_KERNELS=0, FP8BLK_MOE_KERNELS=0): output, input and every parameter
    gradient, with the per-expert loop (4 experts) and the one-launch GEMMs (128)."""
    from fp8blk.torch import mlp
    from fp8blk.torch.moe import grouped

    model = tiny_model("qwen3_moe", device="cuda", num_experts=experts)
    convert_experts(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 700, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, 700, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(mlp, "KERNELS", on)
        monkeypatch.setattr(grouped, "KERNELS", on)
        outs.append(_run_block(block, block, x, g))
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_block_on_cuda(monkeypatch, recompute):
    """torch.compile (inductor, fullgraph) of a converted MoE block on CUDA traces whole and runs
    forward and backward, with the experts as separate nodes and, with
    grouped.COMPILED_RECOMPUTE, in a checkpointed region keeping h. Inductor fuses the
    gating (silu(g) * u rounded once, where eager rounds silu(g) first), so a product may
    differ by a bf16 step and then quantize to a neighbouring FP8 value: the outputs agree with
    eager's to a relative norm of 2^-6 (FP8 E4M3's step is 2^-3 of a value; a handful of
    flipped elements stay far below it)."""
    from fp8blk.torch.moe import grouped
    monkeypatch.setattr(grouped, "COMPILED_RECOMPUTE", recompute)
    model = tiny_model("qwen3_moe", device="cuda")
    convert_experts(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))
        outs.append((y.float(), xx.grad.float()))
    for a, b in zip(*outs):
        assert torch.linalg.norm(a - b) <= 2.0 ** -6 * torch.linalg.norm(b)


@pytest.mark.parametrize("silu", [False, True])
def test_combine_node_traced_on_cuda(silu):
    """The fused node traced through under torch.compile on CUDA (the one-launch kernels and
    the torch version of the GPU image) gives eager's bytes, gradients included and not zero."""
    grouped_gemm.set_policy("always")
    try:
        got = traced_combine_node("cuda", silu)
    finally:
        grouped_gemm.set_policy("auto")
    for i, (a, b) in enumerate(zip(*got)):
        assert a.any(), i
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), i


@pytest.mark.parametrize("experts", [4, 128])
def test_keep_input_on_cuda_equals(experts):
    """``keep_input`` (the first projection keeps the tokens; the permuted rows quantized
    columnwise in the backward pass, inside the weight gradient's op when compiled) on CUDA:
    output, input and every parameter gradient byte-equal to the block without it, eager and
    compiled (inductor, fullgraph), on the per-expert loop (4 experts) and the one-launch
    GEMMs (128)."""
    model = tiny_model("qwen3_moe", device="cuda", num_experts=experts)
    convert_experts(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 700, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, 700, 256, device="cuda", dtype=torch.bfloat16)
    for compiled in (False, True):
        outs = []
        for keep in (False, True):
            block.experts.fp8blk_keep_input = keep
            torch._dynamo.reset()
            fn = torch.compile(block, fullgraph=True) if compiled else block
            outs.append(_run_block(fn, block, x, g))
        for i, (a, b) in enumerate(zip(*outs)):
            assert a.any() and torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                (compiled, i)


@pytest.mark.parametrize("keep_input", [False, True])
def test_converted_block_in_a_cuda_graph(keep_input):
    """A converted Qwen3-MoE block (its router, the experts on the one-launch grouped GEMMs)
    forward and backward captured in one CUDA graph: no step of it synchronizes with the host.
    Replayed on new inputs, which route differently, its output and every gradient equal
    eager's on those inputs, byte for byte (the same kernels, no atomics)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-launch grouped GEMMs are sm_90a (Hopper)")
    prev = grouped_gemm.set_policy("always")
    try:
        model = tiny_model("qwen3_moe", device="cuda")
        convert_experts(model, keep_input=keep_input)
        block = model.model.layers[0].mlp
        params = list(block.parameters())
        x = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16)

        def step():
            for p in params:
                p.grad = None
            x.grad = None
            y = block(x)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(g)
            return y
        graph, y_static = captured(step)
        x.data.copy_(torch.randn_like(x) * 3)
        g.copy_(torch.randn_like(g))
        graph.replay()
        got = [y_static.clone(), x.grad.clone()] + [p.grad.clone() for p in params]
        y = step()
        want = [y, x.grad] + [p.grad for p in params]
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    finally:
        grouped_gemm.set_policy(prev)


@pytest.fixture
def nccl_comm():
    """A one-rank NCCL process group in this process (TorchComm over it), destroyed after."""
    import socket

    import torch.distributed as dist

    from fp8blk.comm import TorchComm
    if dist.is_initialized():
        pytest.skip("a process group is initialized already")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield TorchComm()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_on_one_gpu_with_nccl(nccl_comm, arch):
    # the expert-parallel module on one rank, NCCL all-to-alls, cuBLASLt GEMMs: with the bf16
    # dispatch every byte of the single-rank module's; with the FP8 dispatch the outputs and
    # input / routing-weight gradients byte for byte, the weight gradients within the second
    # FP8 rounding of their 128x1 operands (docs/torch.md, "Expert parallelism"), the bias
    # gradient within one bf16 step (fp32 partial sums, another order)
    from fp8blk.torch.moe import expert_parallel
    from fp8blk.torch.moe.experts import is_experts_module
    model = tiny_model(arch, device="cuda")
    convert_experts(model)
    base = [m for m in model.modules() if is_experts_module(m)][0]
    tokens = 700
    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden = _skewed_rows(tokens, 256, 2).to("cuda", torch.bfloat16)
    idx = routing_ids(tokens, 2, base.num_experts, "skewed", seed=4, device="cuda")
    weights = torch.rand(tokens, 2, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(tokens, 256, device="cuda", generator=gen).bfloat16()

    def run(module):
        h = hidden.clone().requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        out = module(h, idx, w)
        out.backward(dout)
        return [out, h.grad, w.grad], {n: p.grad for n, p in module.named_parameters()}

    want, want_grads = run(base)
    for fp8 in (False, True):
        ep = copy.deepcopy(base)
        expert_parallel(ep, nccl_comm, fp8_dispatch=fp8)
        got, grads = run(ep)
        for a, b in zip(got, want):
            assert torch.equal(a, b), fp8
        for n, g in grads.items():
            r = want_grads[n].float()
            if not fp8:
                assert torch.equal(g, want_grads[n]), n
            elif n.endswith("_bias"):
                assert ((g.float() - r).abs() <= 2.0 ** -7 * r.abs() + 1e-30).all(), n
            else:
                assert (g.float() - r).norm() <= 0.25 * r.norm(), n


@pytest.mark.parametrize("compiled", [False, True])
def test_combine_gradient_on_cuda(compiled):
    """combine's gather-form gradient on CUDA (inductor's Triton code when compiled) equals
    autograd's index backward (zeros, then an atomic scatter there) byte for byte, -0 as +0."""
    got = combine_against_index("cuda", compiled, tokens=700, top_k=4, experts=16,
                                width=512)
    for i, (a, b) in enumerate(zip(*got)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
