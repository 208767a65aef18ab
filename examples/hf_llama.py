"""A Hugging Face Llama trained with fp8blk: convert, train, save a checkpoint, reload it.

    python examples/hf_llama.py                        # tiny, CPU, ~20 s
    python examples/hf_llama.py --large                # a GPU: Llama-3-8B widths, 4 layers

Needs transformers (``pip install 'fp8blk[transformers]'``). The model is built from a config
(no download): ``LlamaForCausalLM`` in bf16 with SDPA attention. Then

1. ``convert_to_float8_block(model, module_filter_fn=..., share_quantize=True, norms=True,
   gated_mlps=True, keep_inputs=True)``: every ``nn.Linear`` but ``lm_head`` becomes a
   Float8BlockLinear (its three GEMMs in block-scaled FP8), layers reading one tensor share
   its FP8 copies, the RMSNorms keep only their input between the passes, the MLPs do not keep
   their activation's output, and the attention output and down projections keep no FP8 copy
   of an input that is kept anyway. The parameters and the state dict are unchanged.
2. ``--steps`` AdamW steps on random tokens.
3. ``torch.save`` of the model's and the optimizer's state dicts; a second model built and
   converted the same way loads them.
4. Checks: the reloaded model's loss on a fixed batch equals the trained model's byte for byte,
   one more training step of each gives the same loss and parameters, and the checkpoint loads
   into an unconverted bf16 model too (same keys), whose loss is close to the FP8 model's.

Prints ``checks: PASSED`` or exits 1 naming the failed check.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from fp8blk.torch import convert_to_float8_block


def build(args, device, convert=True):
    import transformers

    widths = (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32768) if args.large else
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512))
    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers,
                                   max_position_embeddings=args.seq,
                                   tie_word_embeddings=False, **widths)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    if convert:
        convert_to_float8_block(model, module_filter_fn=lambda m, fqn: fqn != "lm_head",
                                share_quantize=True, norms=True, gated_mlps=True,
                                keep_inputs=True)
    return model


def optimizer(model, device):
    cuda = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda, foreach=not cuda)


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true",
                        help="Llama-3-8B widths on a GPU (default: tiny, on the CPU)")
    parser.add_argument("--layers", type=int, default=None, help="default 2 (--large: 4)")
    parser.add_argument("--seq", type=int, default=None, help="default 128 (--large: 4096)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda with --large, else cpu")
    parser.add_argument("--checkpoint", default=None,
                        help="where to save (default: a temporary directory)")
    args = parser.parse_args(argv)
    args.layers = args.layers or (4 if args.large else 2)
    args.seq = args.seq or (4096 if args.large else 128)
    device = torch.device(args.device or ("cuda" if args.large else "cpu"))

    model = build(args, device)
    n_fp8 = sum(type(m).__name__ == "Float8BlockLinear" for m in model.modules())
    n_norm = sum(type(m).__name__ == "Float8BlockRMSNorm" for m in model.modules())
    print(f"LlamaForCausalLM, {args.layers} layers, hidden {model.config.hidden_size}: "
          f"{n_fp8} Float8BlockLinear, {n_norm} Float8BlockRMSNorm, lm_head in bf16")
    opt = optimizer(model, device)
    gen = torch.Generator(device=device).manual_seed(1)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=gen)
               for _ in range(args.steps + 2)]
    for i in range(args.steps):
        print(f"step {i}: loss {float(train_step(model, opt, batches[i])):.4f}")

    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or os.path.join(tmp, "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        state = torch.load(path, map_location=device, weights_only=True)
    reloaded = build(args, device)
    reloaded.load_state_dict(state["model"])
    opt2 = optimizer(reloaded, device)
    opt2.load_state_dict(state["optimizer"])
    probe = batches[args.steps]
    with torch.no_grad():
        a = model(input_ids=probe, labels=probe).loss
        b = reloaded(input_ids=probe, labels=probe).loss
    checks.append(("reloaded model: same loss byte for byte", torch.equal(a, b)))
    la = train_step(model, opt, batches[args.steps + 1])
    lb = train_step(reloaded, opt2, batches[args.steps + 1])
    same_params = all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                        reloaded.parameters()))
    checks.append(("one more step after reloading: same loss and parameters",
                   torch.equal(la, lb) and same_params))
    plain = build(args, device, convert=False)
    missing = plain.load_state_dict(state["model"])
    with torch.no_grad():
        c = plain(input_ids=probe, labels=probe).loss
    rel = abs(float(c) - float(a)) / float(a)
    checks.append((f"unconverted bf16 model loads the checkpoint (loss {float(c):.4f} vs FP8 "
                   f"{float(a):.4f})", not missing.missing_keys and not missing.unexpected_keys
                   and rel < 0.05))
    for name, ok in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    ok = all(ok for _, ok in checks)
    print("checks:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
