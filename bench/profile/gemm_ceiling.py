"""How fast could a Float8BlockLinear step be with a faster FP8 GEMM? The three GEMMs of a
step (fwd y = x W^T, dgrad dx = dY W, wgrad dW = dY^T x) at the bench_linear shapes, timed
with every scaling cuBLAS offers on this GPU, beside bf16:

- ``blockwise``: fp8blk's GEMMs (1x128 x 128x128 for fwd and dgrad, 1x128 x 1x128 over the
  tokens for wgrad), what a step runs;
- ``rowwise``: ``torch._scaled_mm`` with one fp32 scale per row of A and per column of B;
- ``tensorwise``: ``torch._scaled_mm`` with one scale per operand, cuBLAS's fastest FP8 GEMM
  (no per-block promotion work at all): a ceiling for any blockwise kernel of cuBLAS's make;
- ``bf16``: ``torch.mm``.

Each GEMM is timed alone, the cases interleaved (bench_linear.interleaved_ms), behind a GPU
sleep (the GPU work alone) and back to back (sustained: FP8 GEMMs are power bound, the clock
drops). The projection per shape: bf16's three GEMMs over (FP8 GEMMs + the step's quantize
kernels), the step's ratio if every other cost were zero.

    python3 -m bench.profile.gemm_ceiling [--shapes 0,1,2] [--out F.json]
"""
import argparse
import datetime
import json
import platform
import sys

from bench.bench_linear import SHAPES, breakdown_fns, interleaved_ms, step_operands

import torch

from fp8blk.torch import blockwise_scaled_mm

DEV = "cuda"
F8 = torch.float8_e4m3fn


def gemm_cases(m, k, n):
    """{gemm: {scaling: callable}} for the three GEMMs of a (tokens m, in k, out n) step."""
    _, (x, w, dy), block = step_operands(m, k, n)
    bf16 = {"fwd": (x, w.t()), "dgrad": (dy, w), "wgrad": (dy.t(), x)}
    cases = {}
    for gemm, (a16, b16) in bf16.items():
        # the FP8 operands of the plain scalings: A row-major, B column-major, as cuBLAS needs
        a8 = a16.to(F8).contiguous()
        b8 = b16.t().to(F8).contiguous().t()
        one = torch.ones((), device=DEV)
        sa = torch.ones(a8.shape[0], 1, device=DEV)
        sb = torch.ones(1, b8.shape[1], device=DEV)
        ops = block[gemm]
        cases[gemm] = {
            "bf16": lambda a=a16, b=b16: torch.mm(a, b),
            "tensorwise": lambda a=a8, b=b8, s=one: torch._scaled_mm(
                a, b, scale_a=s, scale_b=s, out_dtype=torch.bfloat16),
            "rowwise": lambda a=a8, b=b8, s=sa, t=sb: torch._scaled_mm(
                a, b, scale_a=s, scale_b=t, out_dtype=torch.bfloat16),
            "blockwise": lambda o=ops: blockwise_scaled_mm(*o, out_dtype=torch.bfloat16),
        }
    return cases


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0,1,2")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
              "date": datetime.date.today().isoformat(),
              "command": "python3 " + " ".join(sys.argv), "torch": torch.__version__,
              "cases": []}
    for i in map(int, args.shapes.split(",")):
        m, k, n = SHAPES[i]
        flop = 2 * m * k * n
        case = {"tokens": m, "in": k, "out": n, "alone_ms": {}, "sustained_ms": {},
                "tflops_alone": {}, "tflops_sustained": {}}
        for gemm, fns in gemm_cases(m, k, n).items():
            # ~20 GEMMs of at most ~3 ms are issued in well under the 60 ms sleep
            alone = interleaved_ms(fns, inner=10, repeats=7, prefill_ms=60)
            sustained = interleaved_ms(fns, inner=40, repeats=5)
            case["alone_ms"][gemm], case["sustained_ms"][gemm] = alone, sustained
            case["tflops_alone"][gemm] = {s: flop / v / 1e9 for s, v in alone.items()}
            case["tflops_sustained"][gemm] = {s: flop / v / 1e9 for s, v in sustained.items()}
            print(f"({m}, {k}, {n}) {gemm:5s} TFLOP/s alone / sustained: " + ", ".join(
                f"{s} {case['tflops_alone'][gemm][s]:.0f} / "
                f"{case['tflops_sustained'][gemm][s]:.0f}" for s in fns), flush=True)
        quant = interleaved_ms({"quantize": breakdown_fns(m, k, n)["quantize"]},
                               inner=10, repeats=7, prefill_ms=60)["quantize"]
        case["quantize_ms"] = quant
        for key in ("alone_ms", "sustained_ms"):
            tot = {s: sum(case[key][g][s] for g in case[key]) for s in fns}
            case[key.replace("_ms", "_gemms_total_ms")] = tot
            case[key.replace("_ms", "_projected_vs_bf16")] = {
                s: tot["bf16"] / (tot[s] + quant) for s in tot if s != "bf16"}
        print(f"({m}, {k}, {n}) quantize {quant:.3f} ms; step vs bf16 if the GEMMs were the "
              f"only other cost, alone: " + ", ".join(
                  f"{s} {v:.2f}x" for s, v in case["alone_projected_vs_bf16"].items())
              + "; sustained: " + ", ".join(
                  f"{s} {v:.2f}x" for s, v in case["sustained_projected_vs_bf16"].items()),
              flush=True)
        result["cases"].append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
