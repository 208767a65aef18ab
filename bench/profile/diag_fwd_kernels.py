"""Where a grouped forward's GPU time goes at Mixtral gate/up (quantization included)."""
import torch
from torch.profiler import profile, ProfilerActivity
from bench.bench_moe import SHAPES, routing_ids
from fp8blk.torch import Float8BlockConfig
from fp8blk.torch.moe import grouped_linear, permute, route

for name in ("mixtral_gate_up", "qwen3_30b_gate_up"):
    experts, top_k, tokens, k, n = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    ids = routing_ids(tokens, top_k, experts, False, gen).cuda()
    hidden = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).requires_grad_(True)
    cfg = Float8BlockConfig()
    r = route(ids, experts); r.host()
    x_pad = permute(hidden, r)
    for _ in range(3):
        grouped_linear(x_pad, w, r, cfg)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            grouped_linear(x_pad, w, r, cfg)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    ev.sort(key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start
    print(name, "kernels of 3 calls:")
    for e in ev:
        print(f"  {e.time_range.start - t0:10.1f} {e.time_range.elapsed_us():9.1f}  {e.name[:90]}")
