"""Host cost of a Python torch op per call, eager and inside a compiled graph: the high-level
``torch.library.custom_op`` against ``Library.define`` + ``impl`` (the registration of
fp8blk/torch/_linear_ops.py), each with a trivial implementation (two small allocations), and
the plain Python function for reference. Run on the GPU machine:

    python3 -m bench.profile.op_overhead
"""
import time

import torch


def _impl(x, key, flag):
    return (torch.empty_strided((4,), (1,), device=x.device),
            torch.empty_strided((4,), (1,), device=x.device))


def _fake(x, key, flag):
    return x.new_empty((4,)), x.new_empty((4,))


@torch.library.custom_op("opbench::high", mutates_args=())
def _high(x: torch.Tensor, key: str, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x, key, flag)


_high.register_fake(_fake)
_lib = torch.library.Library("opbench", "FRAGMENT")
_lib.define("low(Tensor x, str key, bool flag) -> (Tensor, Tensor)")
_lib.impl("low", _impl, "CUDA")
torch.library.register_fake("opbench::low", _fake, lib=_lib)


def per_call_us(fn, x, n=20000):
    for _ in range(200):
        fn(x, "k", True)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x, "k", True)
    return (time.perf_counter() - t0) / n * 1e6


def main():
    x = torch.randn(256, 256, device="cuda")
    high, low = torch.ops.opbench.high, torch.ops.opbench.low
    for name, fn in (("python fn", _impl), ("custom_op", high), ("Library.define+impl", low)):
        print(f"{name} {per_call_us(fn, x):.2f} us", flush=True)
    with torch.no_grad():
        for name, fn in (("custom_op (no_grad)", high), ("define+impl (no_grad)", low)):
            print(f"{name} {per_call_us(fn, x):.2f} us", flush=True)
    for name, op in (("compiled 2x custom_op", high), ("compiled 2x define+impl", low)):
        def two(t, op=op):
            a, _ = op(t, "k", True)
            return op(a, "k", True)[1]
        compiled = torch.compile(two, fullgraph=True)
        print(f"{name} {per_call_us(lambda t, k, f: compiled(t), x, 5000):.2f} us", flush=True)


if __name__ == "__main__":
    main()
