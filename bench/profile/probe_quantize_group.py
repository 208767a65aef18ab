"""The quantize launches a Float8BlockLinear pass makes, separately and as one group launch
(``fp8blk.kernels.quantize.quantize_group``, the lean path's ``quantize_group_site``): GPU
time of each, interleaved (prefilled with a GPU sleep so the host's issuing is not timed),
and the same bytes checked first. Forward: x (M, K) 1x128 rowwise + columnwise and W (N, K)
128x128 rowwise; backward: dY (M, N) 1x128 both ways (e5m2) and W 128x128 columnwise, and a
``keep_input`` layer's x columnwise with them.

    python3 -m bench.profile.probe_quantize_group [--out F.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

SHAPES = [(8192, 4096, 4096), (8192, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048),
          (16384, 4096, 14336)]


def parts(m, k, n, which):
    import torch

    from fp8blk.torch import Float8BlockConfig
    cfg = Float8BlockConfig()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    x, w = rand(m, k), rand(n, k)
    if which == "fwd":
        return [(x, cfg.activation, True, True), (w, cfg.weight, True, False)]
    out = [(rand(m, n), cfg.grad, True, True), (w, cfg.weight, False, True)]
    return out + ([(x, cfg.activation, False, True)] if which == "bwd_keep" else [])


def main():
    import torch

    from bench.bench_linear import interleaved_ms
    from fp8blk.kernels.quantize import quantize, quantize_group
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "command": "python3 " + " ".join(sys.argv),
           "cases": []}
    for m, k, n in SHAPES:
        for which in ("fwd", "bwd", "bwd_keep"):
            ps = parts(m, k, n, which)
            grouped = [(x, r, rw, cw, None) for x, r, rw, cw in ps]
            got = quantize_group(grouped)
            equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                        for (x, r, rw, cw), bufs in zip(ps, got)
                        for a, b in zip(bufs, quantize(x, r, rw, cw)) if a is not None)
            fns = {"separate": lambda ps=ps: [quantize(x, r, rw, cw) for x, r, rw, cw in ps],
                   "group": lambda g=grouped: quantize_group(g)}
            ms = interleaved_ms(fns, inner=20, repeats=7, warmup=3, prefill_ms=5.0)
            case = dict(m=m, k=k, n=n, launch=which, equal=equal,
                        separate_us=round(ms["separate"] * 1e3, 1),
                        group_us=round(ms["group"] * 1e3, 1),
                        group_vs_separate=round(ms["separate"] / ms["group"], 3))
            res["cases"].append(case)
            print(case, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
