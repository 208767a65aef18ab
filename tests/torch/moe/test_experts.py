"""transformers' experts modules on fp8blk's grouped FP8 path (fp8blk/torch/moe/experts.py),
CPU, tiny configs of Qwen3-MoE, Mixtral, DeepSeek-V3, OLMoE and gpt-oss: which modules are
converted (experts yes, routers no), a whole model's loss and gradients against the same model
running the per-expert dense loop (tests/torch/moe/_reference.py), state-dict keys, a save /
reload round trip and a plain Hugging Face checkpoint loaded into a converted model; the fused
down projection and combine against the two-node path (tests/torch/moe/_reference.py), bytes
and what is kept between the passes."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.integrations import moe as hf_moe  # noqa: E402

from fp8blk.layout import cdiv, round_up  # noqa: E402
from fp8blk.torch.moe import convert_experts  # noqa: E402
from fp8blk.torch.moe.experts import is_experts_module  # noqa: E402

from .._parity import saved_storages  # noqa: E402
from ._reference import (CONFIGS, experts_loop, routing_ids, tiny_model,  # noqa: E402
                         traced_combine_node, two_node_experts)

LOOP, TWO_NODE = "fp8blk_test_loop", "fp8blk_test_two_node"
for _name, _fn in ((LOOP, experts_loop), (TWO_NODE, two_node_experts)):
    if _name not in hf_moe.ALL_EXPERTS_FUNCTIONS:
        type(hf_moe.ALL_EXPERTS_FUNCTIONS).register(_name, _fn)


def _close_bf16(a, b):
    """Equal but for the order of fp32 sums: a padded segment's zero rows change how the CPU
    matmul of the emulation blocks its reduction over tokens, so a weight gradient may round
    to the neighbouring bf16 value (at most 2^-8 relative) or, where the sum cancels, differ
    by fp32 rounding of the terms (below 2^-16 of the largest)."""
    a, b = a.float(), b.float()
    tol = 2.0 ** -8 * torch.maximum(a.abs(), b.abs()) + 2.0 ** -16 * b.abs().max()
    return bool(((a - b).abs() <= tol).all())


def _step(model, ids):
    for p in model.parameters():
        p.grad = None
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_equals_the_per_expert_loop(name):
    model = tiny_model(name)
    loop = copy.deepcopy(model)
    loop.config._experts_implementation = LOOP
    converted = convert_experts(model)
    layers = model.config.num_hidden_layers - model.config.to_dict().get(
        "first_k_dense_replace", 0)
    assert len(converted) == layers and all(c.endswith("experts") for c in converted)
    routers = [m for n, m in model.named_modules() if n.endswith(("gate", "router"))
               and not is_experts_module(m)]
    assert routers and all(type(m).__module__.startswith("transformers") for m in routers)
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    loss, grads = _step(model, ids)
    ref_loss, ref_grads = _step(loop, ids)
    assert torch.equal(loss, ref_loss)
    for n, g in grads.items():
        if "experts." in n and "shared" not in n and not n.endswith("bias"):
            assert _close_bf16(g, ref_grads[n]), n
        else:                       # routers, attention, norms, embeddings, biases
            assert torch.equal(g, ref_grads[n]), n
    assert any(("gate" in n or "router" in n) and "experts" not in n and g.abs().sum() > 0
               for n, g in grads.items())               # the router learns through the FP8 path


def test_block_with_empty_and_sub128_experts_equals_the_loop():
    model = tiny_model("qwen3_moe")
    module = [m for m in model.modules() if is_experts_module(m)][0]
    convert_experts(model)
    for kind, tokens in (("skewed", 300), ("balanced", 7)):
        idx = routing_ids(tokens, 2, module.num_experts, kind, seed=1)
        h = torch.randn(tokens, 256, dtype=torch.bfloat16)
        w = torch.rand(tokens, 2, dtype=torch.bfloat16)
        outs = []
        for fn in (module, lambda *a: experts_loop(module, *a)):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(hh, idx, ww)
            y.backward(torch.ones_like(y))
            outs.append((y, hh.grad, ww.grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


def test_state_dict_save_reload_and_plain_checkpoint(tmp_path):
    model = tiny_model("mixtral").eval()          # from_pretrained gives eval mode
    plain_keys = list(model.state_dict())
    convert_experts(model)
    assert list(model.state_dict()) == plain_keys
    model.save_pretrained(tmp_path)
    assert "fp8blk" not in (tmp_path / "config.json").read_text()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert reloaded.config._experts_implementation != "fp8blk"
    for (n, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), n
    convert_experts(reloaded)
    ids = torch.randint(0, 256, (1, 64))
    assert torch.equal(model(ids).logits, reloaded(ids).logits)
    # a plain checkpoint into an already converted model
    fresh = tiny_model("mixtral", seed=1).eval()
    convert_experts(fresh)
    fresh.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16).state_dict())
    assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_filter_config_and_errors():
    import fp8blk as fb
    from fp8blk.torch import Float8BlockConfig
    model = tiny_model("qwen3_moe")
    ids = torch.randint(0, 256, (1, 32))
    plain = model(ids).logits
    assert convert_experts(model, module_filter_fn=lambda m, fqn: ".0." in fqn) == [
        "model.layers.0.mlp.experts"]
    left = model.model.layers[1].mlp.experts
    assert "fp8blk_config" not in left.__dict__ and left.fp8blk_fallback == "grouped_mm"
    assert convert_experts(model) == ["model.layers.0.mlp.experts",
                                      "model.layers.1.mlp.experts"]      # again: same config
    assert not torch.equal(model(ids).logits, plain)
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.*already"):
        convert_experts(model, Float8BlockConfig(grad=fb.Block1D(fb.E5M2)))
    with pytest.raises(ValueError, match="Block2D"):
        convert_experts(tiny_model("qwen3_moe"), Float8BlockConfig.mxfp8())
    module = model.model.layers[0].mlp.experts
    module._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        model(ids)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_compiled_block_has_no_graph_break(name):
    """torch.compile(fullgraph=True) of a MoE block (router, routing, the per-expert ops):
    it traces whole, and under aot_eager (the same aten ops as eager) forward and backward
    give eager's bytes."""
    model = tiny_model(name)
    convert_experts(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 150, 256, dtype=torch.bfloat16)
    outs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        for p in block.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))
        outs.append([y, xx.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_convert_to_float8_block_experts_option_and_report():
    from fp8blk.torch import conversion_report, convert_to_float8_block
    model = tiny_model("qwen3_moe")
    convert_to_float8_block(model)                  # experts converted by default
    report = conversion_report(model)
    assert report["experts"].converted == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    assert not report["experts"].left
    assert report["router"].left and not report["router"].converted
    model = tiny_model("qwen3_moe")
    convert_to_float8_block(model, experts=False)   # switched off
    report = conversion_report(model, experts=False)
    assert not report["experts"].converted
    assert {x.reason for x in report["experts"].left} == {"experts=False"}
    model = tiny_model("qwen3_moe")
    head = lambda m, fqn: ".1." not in fqn           # noqa: E731  layer 1 left out
    convert_to_float8_block(model, module_filter_fn=head, experts=True)
    report = conversion_report(model, module_filter_fn=head, experts=True)
    assert report["experts"].converted == ["model.layers.0.mlp.experts"]
    assert [(x.fqn, x.reason) for x in report["experts"].left] == [
        ("model.layers.1.mlp.experts", "filtered out by module_filter_fn")]


def _saved_storage_bytes(fn):
    return sum(saved_storages(fn)[1].values())


def test_silu_gating_keeps_the_projection_alone():
    """transformers' default SiLU gating runs inside the last node (grouped_linear_combine's
    ``silu_gated``): the same bytes (the loop tests), and neither SiLU's output (padded rows x
    intermediate, bf16) nor the gated rows' FP8 buffers (rowwise and columnwise, one byte per
    element and their fp32 scales) are kept: the gate/up projection's output h alone."""
    model = tiny_model("qwen3_moe")
    convert_experts(model)
    module = [m for m in model.modules() if is_experts_module(m)][0]
    assert module.fp8blk_silu_gate
    idx = routing_ids(200, 2, module.num_experts, "balanced")
    h = torch.randn(200, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(200, 2, dtype=torch.bfloat16, requires_grad=True)
    lean = _saved_storage_bytes(lambda: module(h, idx, w))
    module.fp8blk_silu_gate = False                    # the model's own _apply_gate
    plain = _saved_storage_bytes(lambda: module(h, idx, w))
    from fp8blk.torch.moe import route
    rows = route(idx, module.num_experts).rows
    inter = module.down_proj.shape[2]
    fp8_copies = 2 * rows * inter + 4 * (cdiv(inter, 128) * round_up(rows, 4)
                                         + cdiv(rows, 128) * round_up(inter, 4))
    assert plain - lean == rows * inter * 2 + fp8_copies


def _same_bytes(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _assert_same_step(model, ref):
    """One training step's loss and every gradient of ``model`` equal ``ref``'s, as bytes."""
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    loss, grads = _step(model, ids)
    ref_loss, ref_grads = _step(ref, ids)
    assert _same_bytes(loss, ref_loss)
    for n, g in grads.items():
        assert _same_bytes(g, ref_grads[n]), n


def _converted_with_biases(name):
    """A tiny model of ``name`` with its experts converted and its biases (zeros at init)
    drawn at random, so that they count."""
    model = tiny_model(name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    convert_experts(model)
    return model


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_model_equals_the_two_node_path(name):
    """The down projection and combine as one node (y recomputed for the router weights'
    gradient, not kept): a whole model's loss and every gradient, routers included, equal the
    two-node path's byte for byte (Mixtral: an intermediate width not a multiple of 128;
    gpt-oss: transposed weights, biases, its own gating)."""
    model = _converted_with_biases(name)
    two = copy.deepcopy(model)
    two.config._experts_implementation = TWO_NODE
    _assert_same_step(model, two)


def test_the_experts_keep_no_expert_outputs():
    """Between the passes the fused path keeps no (T*k, H) high-precision tensor (the
    two-node path keeps the expert outputs for the router weights' gradient), nor the down
    projection's FP8 input (its columnwise copy and scales, which the two-node path keeps for
    the weight gradient): both are made again from h (saved_tensors_hooks)."""
    model = tiny_model("qwen3_moe")
    convert_experts(model)
    module = [m for m in model.modules() if is_experts_module(m)][0]
    tokens, top_k, hidden = 200, 2, 256
    idx = routing_ids(tokens, top_k, module.num_experts, "balanced")
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(tokens, top_k, dtype=torch.bfloat16, requires_grad=True)
    shapes = []

    def pack(t):
        shapes.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(h, idx, w)
    assert not [s for s, d in shapes if d.is_floating_point and d.itemsize > 1 and
                s == (tokens * top_k, hidden)]
    lean = _saved_storage_bytes(lambda: module(h, idx, w))
    two = _saved_storage_bytes(lambda: two_node_experts(module, h, idx, w))
    from fp8blk.torch.moe import route
    rows, inter = route(idx, module.num_experts).rows, module.down_proj.shape[2]
    columnwise = rows * inter + cdiv(rows, 128) * round_up(inter, 4) * 4    # 128x1 FP8, scales
    assert two - lean == tokens * top_k * hidden * 2 + columnwise


def test_a_norm_after_the_experts_keeps_the_two_nodes():
    """``has_post_expert_norm`` (a norm between the down projection and the combine): the
    experts run the two-node path with the norm, the bytes of the reference's."""
    model = tiny_model("qwen3_moe")
    convert_experts(model)
    module = [m for m in model.modules() if is_experts_module(m)][0]
    module.has_post_expert_norm = True
    module.post_expert_norm = torch.nn.RMSNorm(256, dtype=torch.bfloat16)
    with torch.no_grad():
        module.post_expert_norm.weight.uniform_(0.5, 2)
    idx = routing_ids(150, 2, module.num_experts, "skewed")
    h0 = torch.randn(150, 256, dtype=torch.bfloat16)
    w0 = torch.rand(150, 2, dtype=torch.bfloat16)
    got = []
    for fn in (module, lambda *a: two_node_experts(module, *a)):
        module.zero_grad(set_to_none=True)
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(h, idx, w)
        out.backward(torch.ones_like(out))
        got.append([out, h.grad, w.grad, module.post_expert_norm.weight.grad])
    for a, b in zip(*got):
        assert _same_bytes(a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_recompute_node(monkeypatch, backend):
    """Compiled with grouped.COMPILED_RECOMPUTE, the gating, the down projection and the
    combine run in a checkpointed region, traced with fullgraph. Under aot_eager the output,
    input and parameter gradients are eager's, byte for byte; under inductor (which fuses the
    gating, silu(g) * u rounded once where eager rounds silu(g) first) they are the bytes of
    the compiled block without the region: the recomputation makes the same values."""
    from fp8blk.torch.moe import grouped
    model = tiny_model("qwen3_moe")
    convert_experts(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 300, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    runs = [(False, block)] if backend == "aot_eager" else \
        [(False, torch.compile(block, fullgraph=True, backend=backend))]
    runs.append((True, torch.compile(block, fullgraph=True, backend=backend)))
    outs = []
    for recompute, fn in runs:
        monkeypatch.setattr(grouped, "COMPILED_RECOMPUTE", recompute)
        torch._dynamo.reset()
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y))
        outs.append([y, xx.grad] + [p.grad for p in block.parameters()])
        for p in block.parameters():
            p.grad = None
    assert len(outs[0]) == len(outs[1]) == 5
    for i, (a, b) in enumerate(zip(*outs)):
        assert a.any(), i
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), i


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_compiled_recompute_keeps_what_eager_keeps(monkeypatch, name):
    """Under inductor the checkpointed region (grouped.COMPILED_RECOMPUTE) keeps h, not the
    expert outputs or the gated rows' FP8 copies, where the separate nodes keep those too:
    with SiLU gating exactly what the eager block keeps; with gpt-oss's own gating (and
    biases) less, as eager keeps the gated rows' FP8 copies beside what autograd keeps for
    the gating."""
    from fp8blk.torch.moe import grouped
    model = tiny_model(name)
    convert_experts(model)
    block = model.model.layers[0].mlp
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(1, 300, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))

    def kept(fn):
        xx = x.clone().requires_grad_()
        fn(xx)                                           # compiles, outside the count
        out, seen = saved_storages(lambda: fn(xx))
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        return sum(n for ptr, n in seen.items() if ptr not in params)

    eager = kept(block)
    got = {}
    for recompute in (False, True):
        monkeypatch.setattr(grouped, "COMPILED_RECOMPUTE", recompute)
        torch._dynamo.reset()
        got[recompute] = kept(torch.compile(block, fullgraph=True))
    assert got[True] < got[False], (eager, got)
    assert got[True] == eager if name == "qwen3_moe" else got[True] < eager, (eager, got)


@pytest.mark.parametrize("silu", [False, True])
def test_combine_node_traced_equals_eager(silu):
    """The fused node traced through under torch.compile gives eager's bytes, gradients
    included. (torch 2.11's dynamo returned every intermediate of an autograd function's
    forward as an output and, where the function returned a no-op ``.to`` of one, handed the
    output's gradient to the alias: all-zero gradients; ``routing.weighted_sum`` skips the
    no-op cast. The GPU twin runs where that torch is installed.)"""
    for i, (a, b) in enumerate(zip(*traced_combine_node("cpu", silu))):
        assert a.any(), i
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), i


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_keep_input_model_equals_and_keeps_the_tokens(name):
    """``keep_input`` (convert_to_float8_block's ``keep_inputs``): the first projection keeps
    the tokens, which the router keeps anyway, instead of the permuted rows' columnwise FP8
    copy; a whole model's loss and every gradient equal the unkept path's byte for byte
    (gpt-oss: transposed weights and biases), and each experts block keeps exactly that
    copy's bytes fewer (with permute's index, which the routing holds). Where the tokens
    would take more bytes than the copy (top-1, few padding rows) the copy is kept."""
    model = _converted_with_biases(name)
    keep = copy.deepcopy(model)
    convert_experts(keep, keep_input=True)
    _assert_same_step(keep, model)
    from fp8blk.torch.moe import route
    module = [m for m in keep.modules() if is_experts_module(m)][0]
    width = module.config.hidden_size
    for top_k in (2, 1):
        # top-1, 4000 tokens to one expert: the padded layout (4000 + 127 E rows, its bound)
        # takes fewer bytes than the tokens
        tokens = 200 if top_k == 2 else 4000
        idx = (routing_ids(tokens, 2, module.num_experts, "balanced") if top_k == 2 else
               torch.zeros((tokens, 1), dtype=torch.int64))
        h = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
        w = torch.rand(tokens, top_k, dtype=torch.bfloat16, requires_grad=True)
        kept = []
        for flag in (False, True):
            module.fp8blk_keep_input = flag
            kept.append(_saved_storage_bytes(lambda: module(h, idx, w)))
        r = route(idx, module.num_experts)
        columnwise = r.rows * width + cdiv(r.rows, 128) * round_up(width, 4) * 4
        # the tokens are an input here: counted only where the first projection keeps them
        assert kept[0] - kept[1] == (columnwise + r.dest.nbytes - h.nbytes
                                     if top_k == 2 else 0), (top_k, kept)


def test_keep_input_compiled_keeps_the_tokens():
    """Under inductor the permuted rows' columnwise quantization runs inside the weight
    gradient's op (``fp8blk::grouped_mm_weights_tokens``), in the backward pass: the compiled
    block keeps fewer bytes than without ``keep_input`` (as an op of its own the
    partitioner would run it in the forward pass and keep its output), with the same output
    and gradients, byte for byte."""
    model = tiny_model("qwen3_moe")
    convert_experts(model)
    block = model.model.layers[0].mlp
    module = block.experts
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(1, 300, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    got, kept = [], []
    for flag in (False, True):
        module.fp8blk_keep_input = flag
        torch._dynamo.reset()
        fn = torch.compile(block, fullgraph=True)
        xx = x.clone().requires_grad_()
        fn(xx)                                           # compiles, outside the count
        out, seen = saved_storages(lambda: fn(xx))
        y = out[0] if isinstance(out, tuple) else out
        y.backward(torch.ones_like(y))
        kept.append(sum(n for ptr, n in seen.items() if ptr not in params))
        got.append([y, xx.grad] + [p.grad for p in block.parameters()])
        block.zero_grad(set_to_none=True)
    for i, (a, b) in enumerate(zip(*got)):
        assert a.any() and _same_bytes(a, b), i
    tokens = 300
    from fp8blk.torch.moe import route
    r = route(routing_ids(tokens, 2, module.num_experts, "balanced"), module.num_experts)
    # at least the copy's data (one byte a padded row's element) less the tokens' bf16
    assert kept[0] - kept[1] >= r.rows * 256 - tokens * 256 * 2, kept
