"""A Hugging Face Qwen3-MoE trained with fp8blk's FP8 experts: convert, train with the router's
auxiliary loss, save a Hugging Face checkpoint, reload it.

    python examples/hf_moe.py                   # tiny, CPU
    python examples/hf_moe.py --large           # a GPU: Qwen3-30B-A3B widths, 2 layers

Needs transformers (``pip install 'fp8blk[transformers]'``). The model is built from a config
(no download): ``Qwen3MoeForCausalLM`` in bf16, ``output_router_logits`` on (the load-balancing
loss joins the loss). Then

1. ``convert_to_float8_block(model, experts=True, module_filter_fn=...)``: every experts
   module (3-D ``gate_up_proj`` / ``down_proj``) runs its GEMMs in block-scaled FP8 through
   transformers' ``ExpertsInterface`` (``fp8blk.torch.moe``); routers stay as they are; the
   attention projections become Float8BlockLinear (``lm_head`` left in bf16) and, by
   default, the RMSNorms are swapped, quantizes shared and o_proj's input kept
   (docs/torch.md, "Whole models"); what was converted and left is logged at INFO.
2. ``--steps`` AdamW steps on random tokens; the experts' load (routed rows per expert, the
   first MoE layer) printed after the last.
3. ``save_pretrained`` (a plain Hugging Face checkpoint: same keys, no fp8blk in the config),
   ``from_pretrained`` and the same conversion.
4. Checks: the reloaded model's loss on a fixed batch equals the trained model's byte for byte,
   the checkpoint's state dict has the unconverted model's keys, and an unconverted bf16 model
   loading it has a loss close to the FP8 model's.

Prints ``checks: PASSED`` or exits 1 naming the failed check.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from fp8blk.torch import convert_to_float8_block
from fp8blk.torch.moe import route


def config(args):
    import transformers

    widths = (dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                   num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                   head_dim=128, vocab_size=32768) if args.large else
              dict(hidden_size=256, moe_intermediate_size=128, num_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, vocab_size=512))
    return transformers.Qwen3MoeConfig(num_hidden_layers=args.layers, output_router_logits=True,
                                       router_aux_loss_coef=0.01, tie_word_embeddings=False,
                                       max_position_embeddings=args.seq, **widths)


def convert(model):
    return convert_to_float8_block(model, module_filter_fn=lambda m, fqn: fqn != "lm_head",
                                   experts=True)


def build(args, device, fp8=True):
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM._from_config(config(args), dtype=torch.bfloat16)
    model = model.to(device)
    return convert(model) if fp8 else model


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def load(model, ids):
    """Routed rows per expert in the first MoE layer for a batch (the router's top-k)."""
    block = model.model.layers[0].mlp
    seen = {}

    def keep(module, inputs, out):          # returns None: the router's output stays as it is
        seen["idx"] = out[-1]

    handle = block.gate.register_forward_hook(keep)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return route(seen["idx"], block.experts.num_experts).counts.tolist()


def main(argv=None):
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="default 128 (--large: 4096)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda with --large, else cpu")
    args = parser.parse_args(argv)
    args.seq = args.seq or (4096 if args.large else 128)
    device = torch.device(args.device or ("cuda" if args.large else "cpu"))

    model = build(args, device)
    n_experts = sum("fp8blk_config" in m.__dict__ for m in model.modules())
    n_fp8 = sum(type(m).__name__ == "Float8BlockLinear" for m in model.modules())
    print(f"Qwen3MoeForCausalLM, {args.layers} layers: {n_experts} FP8 experts modules, "
          f"{n_fp8} Float8BlockLinear, routers and lm_head in bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device,
                             generator=gen) for _ in range(args.steps + 1)]
    for i in range(args.steps):
        print(f"step {i}: loss {float(train_step(model, opt, batches[i])):.4f}")
    probe = batches[args.steps]
    print("experts' load (rows per expert, layer 0):", load(model, probe))

    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with open(f"{tmp}/config.json") as f:
            plain_config = "fp8blk" not in f.read()
        reloaded = convert(transformers.Qwen3MoeForCausalLM.from_pretrained(
            tmp, dtype=torch.bfloat16).to(device))
        plain = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        plain = plain.to(device)
    model.eval()
    reloaded.eval()
    plain.eval()
    with torch.no_grad():
        a = model(input_ids=probe, labels=probe).loss
        b = reloaded(input_ids=probe, labels=probe).loss
        c = plain(input_ids=probe, labels=probe).loss
    fresh = build(args, device, fp8=False)
    checks.append(("reloaded model: same loss byte for byte", torch.equal(a, b)))
    checks.append(("checkpoint: the unconverted model's keys, a plain config",
                   list(plain.state_dict()) == list(fresh.state_dict()) and plain_config))
    rel = abs(float(c) - float(a)) / float(a)
    checks.append((f"unconverted bf16 model loads it (loss {float(c):.4f} vs FP8 "
                   f"{float(a):.4f})", rel < 0.05))
    for name, ok in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    ok = all(ok for _, ok in checks)
    print("checks:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
