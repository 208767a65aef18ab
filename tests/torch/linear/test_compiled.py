"""fp8blk.torch.linear.compiled on the CPU: what inductor's partitioner keeps between the
passes of a compiled graph of the plan's ops. The ops run here as their fake implementations
(registered for the CPU for these tests only, the plan path let in on the CPU): the graphs,
not the values, are checked; the values are the GPU tests' (test_plans.py)."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402

from fp8blk.torch import convert_to_float8_block  # noqa: E402
from fp8blk.torch.linear import compiled, plans  # noqa: E402

from ..test_mlp import GatedMLP  # noqa: E402


@contextlib.contextmanager
def plan_ops_on_cpu():
    lib = torch.library.Library("fp8blk", "IMPL")
    for name in ("linear_quantize_x", "linear_fwd_mm", "linear_bwd", "linear_bwd_x",
                 "linear_fwd"):
        lib.impl(name, getattr(compiled, f"_{name.removeprefix('linear_')}_fake"), "CPU")
    traceable = plans.traceable
    plans.traceable = lambda x2d, weight, cfg, out_dtype: True
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        plans.traceable = traceable
        lib._destroy()


def _kept(fn, *args):
    """The tensors the compiled forward graph of `fn` keeps for backward (one forward and
    backward), as (shape, dtype) pairs, and the backward graph's fp8blk ops."""
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm
        return compiler
    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"),
                           partition_fn=min_cut_rematerialization_partition)
    torch.compile(fn, backend=backend, fullgraph=True)(*args).float().sum().backward()
    (out,) = [n for n in graphs["fw"].graph.nodes if n.op == "output"]
    kept = [(tuple(a.meta["val"].shape), a.meta["val"].dtype) for a in out.args[0][1:]
            if isinstance(a, torch.fx.Node)]
    ops = [str(n.target).split(".")[1] for n in graphs["bw"].graph.nodes
           if n.op == "call_function" and str(n.target).startswith("fp8blk.")]
    return kept, ops


@pytest.mark.parametrize("keep", [False, True])
def test_gated_mlp_down_projection(keep):
    """A swapped gated MLP, its down projection keeping its input or not: with keep_inputs
    the graph keeps no FP8 copy of the product and no (M, F) tensor but g and u (the product
    is recomputed in backward, then read by the down projection's backward op)."""
    m, d, f = 384, 256, 512
    mlp = torch.nn.Sequential(GatedMLP(d, f)).to(torch.bfloat16)
    convert_to_float8_block(mlp, share_quantize=False, norms=False, gated_mlps=True,
                            keep_inputs=keep)
    x = torch.randn(m, d, dtype=torch.bfloat16, requires_grad=True)
    with plan_ops_on_cpu():
        kept, ops = _kept(mlp, x)
    acts = [s for s, t in kept if t == torch.bfloat16 and m in s]
    assert acts == [(m, f), (m, f)], kept                        # g and u only
    fp8 = sorted(s for s, t in kept if t == torch.float8_e4m3fn)
    assert fp8 == ([(m, d)] if keep else [(m, d), (m, f)]), kept  # x's copy (gate, up share)
    assert ops.count("linear_bwd_x") == int(keep) and ops.count("linear_bwd") == 3 - int(keep)


SEQ = 96        # no weight dimension is 96 or 192


@pytest.mark.timeout(120)
def test_tiny_llama_decoder_layer():
    """A Hugging Face Llama decoder layer compiled, as bench_model's fp8blk_opt (keep_inputs)
    and fp8blk_nokeep convert it: with keep_inputs the graph keeps two FP8 copies (the inputs
    of q/k/v and of gate/up) against four, and no (tokens, F) tensor more: the down
    projection reads the product recomputed from g and u."""
    pytest.importorskip("transformers")
    from bench import bench_model

    def layer_graph(variant):
        model = bench_model.build_model("llama", variant, 1, SEQ, "cpu", tiny=True)
        layer = model.model.layers[0]
        x = torch.randn(2, SEQ, model.config.hidden_size, dtype=torch.bfloat16,
                        requires_grad=True)
        emb = model.model.rotary_emb(x, torch.arange(SEQ).unsqueeze(0).expand(2, -1))

        def run(x):
            out = layer(x, position_embeddings=emb)
            return out[0] if isinstance(out, tuple) else out
        with plan_ops_on_cpu():
            kept, ops = _kept(run, x)
        return model.config, kept, ops

    cfg, kept, ops = layer_graph("fp8blk_opt")
    _, kept0, ops0 = layer_graph("fp8blk_nokeep")
    m, h, f = 2 * SEQ, cfg.hidden_size, cfg.intermediate_size

    def fp8(kept):
        return sorted(s for s, t in kept if t == torch.float8_e4m3fn)

    def activations(kept):      # high precision, of the tokens' shape (not the weights)
        return sorted(k for k in kept if k[1] != torch.float8_e4m3fn
                      and (SEQ in k[0] or m in k[0]))
    assert fp8(kept) == [(m, h), (m, h)], kept
    assert fp8(kept0) == sorted([(m, h), (m, h), (m, h), (m, f)]), kept0
    # the same tensors but one: on the CPU attention's output is (batch, heads, seq, dim)-major,
    # so the (tokens, features) copy HF's transpose + contiguous makes for o_proj is kept
    # (CUDA's flash and cuDNN attention write (batch, seq, heads, dim)-major: no copy)
    assert activations(kept) == sorted(activations(kept0) + [((m, h), torch.bfloat16)]), kept
    assert ops.count("linear_bwd_x") == 2 and ops0.count("linear_bwd_x") == 0
