"""References the MoE tests share: routings (balanced, skewed, with empty and sub-128 experts),
tiny transformers MoE configs, the per-expert loop the grouped path must equal (each expert's
routed rows through the dense float8_block_linear, combined as transformers does), and a
step captured in a CUDA graph."""
from __future__ import annotations

import torch

from fp8blk.torch import float8_block_linear

# tiny configs of four transformers MoE families (widths multiples of 128 where the real
# models have them; Mixtral's intermediate 192 is not, so its down projection's weight is
# quantized per expert)
CONFIGS = {
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=256),
    "mixtral": dict(hidden_size=256, intermediate_size=192, num_local_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256),
    "deepseek_v3": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=256, q_lora_rank=64,
                        kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                        v_head_dim=64, n_group=2, topk_group=1),
    "olmoe": dict(hidden_size=256, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  vocab_size=256, eos_token_id=0, pad_token_id=0, bos_token_id=0),
    "gpt_oss": dict(hidden_size=256, intermediate_size=128, num_local_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=256),
}


def tiny_model(name, dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(name, **{**CONFIGS[name], **overrides})
    # dtype at construction, as from_pretrained does (a .to(dtype) would cast the rotary
    # buffers too)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)


def routing_ids(tokens, top_k, experts, kind, seed=0, device="cpu"):
    """(tokens, top_k) expert ids, distinct per token. ``balanced``: uniform; ``skewed``: the
    last quarter of the experts (at least one) empty, expert 0 in every token's choice (its
    rows past 128, the others' below); ``tiny``: a handful of tokens (every expert < 128)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if kind == "skewed":
        scores[:, experts - max(1, experts // 4):] = -1
        scores[:, 0] = 2
    return scores.argsort(1, descending=True)[:, :top_k].to(device)


def experts_loop(module, hidden, idx, weights):
    """transformers' experts formula with every expert's projections as the dense
    float8_block_linear on its routed rows (in token order)."""
    parts = []
    for e in range(module.num_experts):
        t, j = torch.where(idx == e)
        if len(t) == 0:
            continue
        w1 = module.gate_up_proj[e] if module.has_gate else module.up_proj[e]
        w2 = module.down_proj[e]
        if module.is_transposed:
            w1, w2 = w1.t(), w2.t()
        b1 = b2 = None
        if module.has_bias:
            b1 = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[e]
            b2 = module.down_proj_bias[e]
        h = float8_block_linear(hidden[t], w1, b1)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        y = float8_block_linear(h, w2, b2)
        parts.append((t, j, y * weights[t, j, None]))
    out = hidden.new_zeros((*idx.shape, hidden.shape[1]), dtype=parts[0][2].dtype)
    for t, j, v in parts:
        out = out.index_put((t, j), v)
    return out.sum(1).to(hidden.dtype)


def experts_module(model):
    from fp8blk.torch.moe.experts import is_experts_module
    return [m for m in model.modules() if is_experts_module(m)][0]


def two_node_experts(module, hidden, idx, weights):
    """fp8blk's experts with the down projection and the combine as two autograd nodes
    (``grouped_linear`` then ``routing.combine``: autograd keeps the (T*k, H) expert outputs
    for the router weights' gradient): what ``grouped_linear_combine`` must equal byte for
    byte."""
    from fp8blk.torch.moe.experts import _project, gate
    from fp8blk.torch.moe.routing import combine, permute, route
    cfg = module.fp8blk_config
    routing = route(idx, module.num_experts)
    h = _project(permute(hidden, routing), module,
                 "gate_up_proj" if module.has_gate else "up_proj", routing, cfg)
    y = _project(gate(module, h, routing), module, "down_proj", routing, cfg)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return combine(y, routing, weights, hidden.dtype)


def captured(step):
    """``step()`` captured in a CUDA graph after two warm-up runs on a side stream (torch's
    recipe): (the graph, what the captured run returned: its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def traced_combine_node(device, silu):
    """grouped_linear_combine (the fused node, traced through as an autograd function) eager
    and under torch.compile (aot_eager): [out, dx, dW, d top_k_weights] of each."""
    from fp8blk.torch.moe import permute, route
    from fp8blk.torch.moe.grouped import grouped_linear_combine
    gen = torch.Generator().manual_seed(0)
    tokens, k, h, n = 300, 2, 256, 384
    r = route(routing_ids(tokens, k, 8, "skewed").to(device), 8)
    x0 = permute(torch.randn(tokens, 2 * h if silu else h, generator=gen).to(
        device, torch.bfloat16), r)
    w0 = (torch.randn(8, n, h, generator=gen) * h ** -0.5).to(device, torch.bfloat16)
    tw0 = torch.rand(tokens, k, generator=gen).to(device, torch.bfloat16)
    dout = torch.randn(tokens, n, generator=gen).to(device, torch.bfloat16)

    def f(x, w, tw):
        return grouped_linear_combine(x, w, r, tw, torch.bfloat16, silu_gated=silu)
    got = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        x, w, tw = (t.clone().requires_grad_() for t in (x0, w0, tw0))
        out = fn(x, w, tw)
        out.backward(dout)
        got.append([out.detach(), x.grad, w.grad, tw.grad])
    return got


def combine_against_index(device, compiled, w_dtype=torch.float32, tokens=150, top_k=2,
                          experts=4, width=64):
    """[[out, d rows, d w] of ``routing.combine``, the same of ``weighted_sum(rows[dest])``
    under autograd] on a skewed routing, eager or compiled (inductor): router weights with a
    zero against negative output gradients (a -0 product) and a zero gradient row."""
    from fp8blk.torch.moe.routing import combine, route, weighted_sum
    r = route(routing_ids(tokens, top_k, experts, "skewed", device=device), experts)
    gen = torch.Generator().manual_seed(0)
    rows0 = torch.randn(r.rows, width, generator=gen).to(device, torch.bfloat16)
    w0 = torch.rand(tokens, top_k, generator=gen).to(device, w_dtype)
    w0[3, 0] = 0.0
    dout = torch.randn(tokens, width, generator=gen).to(device, torch.bfloat16)
    dout[3, :4] = -1.0                                  # times the zero weight: -0
    dout[5] = -0.0
    got = []
    for fn in (combine, lambda x, r, w, dt: weighted_sum(x[r.dest], w, dt)):
        torch._dynamo.reset()
        f = torch.compile(fn) if compiled else fn
        rows, w = rows0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = f(rows, r, w, torch.bfloat16)
        out.backward(dout)
        got.append([out, rows.grad, w.grad])
    return got

