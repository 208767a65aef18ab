"""fp8blk/torch/_cublaslt.py: the Linear's GEMMs on cuBLASLt directly (on by default; each
test sets it on or off itself).

On the GPU each signature's ScaledMM gives ``torch._scaled_mm``'s bytes exactly (the same
cuBLASLt algorithm on the same operands), on operands whose scales differ block by block (a
scale or layout mix-up changes the output), on the current stream. On the CPU (CI): where it
cannot serve -- no libcublasLt loaded, turned off, an output dtype other than bf16, fp16 and
fp32 --
``make`` returns None, so the caller keeps ``torch._scaled_mm``."""
import pytest
import torch

from fp8blk.torch import _cublaslt

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _operands(m, n, k, a_dtype, b_dtype, b_blocks, gen, exp=12, scale=1.0):
    """FP8 operands and scales in the layouts torch._scaled_mm takes (module docstring);
    `gen` a CUDA generator; scales 2^[-exp, exp) * [1, 1.5) * `scale`."""
    def fp8(rows, cols, dtype):
        vals = torch.randn(rows, cols, generator=gen, device="cuda") * 100
        return vals.clamp(-400, 400).to(dtype)

    def scales(*shape):
        e = torch.randint(-exp, exp, shape, generator=gen, device="cuda").float()
        return torch.exp2(e) * (1 + 0.5 * torch.rand(shape, generator=gen, device="cuda")) \
            * scale

    a = fp8(m, k, a_dtype)
    b = fp8(n, k, b_dtype).t()                          # (k, n) column-major
    scale_a = scales(k // 128, m).t()                   # (m, k/128), strides (1, m)
    if b_blocks == "128x128":
        scale_b = scales(n // 128, k // 128).t()        # (k/128, n/128), strides (1, k/128)
    else:
        scale_b = scales(k // 128, n)                   # (k/128, n) contiguous
    return a, b, scale_a, scale_b


def _cuda_gen(rng):
    return torch.Generator(device="cuda").manual_seed(int(rng.integers(2 ** 31)))


# the benchmark's 8192-token GEMMs (forward/dgrad 128x128, wgrad 1x128): on the H200 cuBLASLt
# picks algorithms for them that need a workspace
BENCH = [(8192, 4096, 4096, "128x128"), (4096, 4096, 8192, "1x128"),
         (16384, 14336, 4096, "128x128"), (4096, 14336, 16384, "1x128")]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,b_blocks", [
    (m, n, k, b) for m, n, k in [(512, 512, 512), (1024, 1536, 2048), (512, 1536, 1024)]
    for b in ("128x128", "1x128")] + BENCH)
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_equals_torch_scaled_mm(m, n, k, b_blocks, dtypes, out_dtype, rng, monkeypatch):
    monkeypatch.setattr(_cublaslt, "enabled", True)
    gen = _cuda_gen(rng)
    mm = _cublaslt.make(m, n, k, *dtypes, b_blocks, out_dtype, torch.device("cuda", 0))
    assert mm is not None, f"cuBLASLt did not serve the signature: {_cublaslt.refusals}"
    for _ in range(2):                      # the same descriptor, new operands and scales
        # fp16: outputs within its range (|sums| <= ~5e6 at K = 16384, times <= 2^-14)
        a, b, sa, sb = _operands(m, n, k, *dtypes, b_blocks, gen, *(
            (4, 2.0 ** -11) if out_dtype == torch.float16 else ()))
        want = torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)
        got = mm(a, b, sa, sb)
        assert got.dtype == out_dtype
        assert got.shape == want.shape == (m, n) and got.is_contiguous()
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1024, 1024, 1024), (8192, 4096, 4096)])
def test_runs_on_the_current_stream(m, n, k, rng, monkeypatch):
    """Also on a side stream, where the 8192-token GEMM's workspace is allocated."""
    monkeypatch.setattr(_cublaslt, "enabled", True)
    gen = _cuda_gen(rng)
    mm = _cublaslt.make(m, n, k, E4M3, E4M3, "128x128", torch.bfloat16,
                        torch.device("cuda", 0))
    assert mm is not None, _cublaslt.refusals
    a, b, sa, sb = _operands(m, n, k, E4M3, E4M3, "128x128", gen)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)       # the GEMM must wait for this, in stream order
        got = mm(a, b, sa, sb)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_the_linear_plan_runs_its_gemms_on_it(rng, monkeypatch):
    """A Float8BlockLinear step at the benchmark's small shape plans its three GEMMs on
    cuBLASLt (on by default) and gives the bytes of the general path with cuBLASLt turned off
    (torch._scaled_mm)."""
    from fp8blk.torch import Float8BlockLinear
    from fp8blk.torch.linear import hot as linear_hot
    from fp8blk.torch.linear import plans as linear_plans
    monkeypatch.setattr(_cublaslt, "enabled", True)
    gen = _cuda_gen(rng)
    layer = Float8BlockLinear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    scale = torch.exp2(torch.randint(-6, 6, (8192, 1), generator=gen, device="cuda").float())
    x = (torch.randn(8192, 4096, generator=gen, device="cuda") * scale).bfloat16()
    g = (torch.randn(8192, 4096, generator=gen, device="cuda") * scale.flip(0)).bfloat16()
    results = []
    for general in (False, True):
        with monkeypatch.context() as m:
            if general:
                m.setattr(linear_plans, "plan_for", lambda *a: None)
                m.setattr(linear_hot.Hot, "__call__", lambda self, *a: None)   # its memo
                m.setattr(_cublaslt, "enabled", False)
            else:
                linear_plans.plans.clear()
            layer.weight.grad = None
            xr = x.clone().requires_grad_()
            y = layer(xr)
            y.backward(g)
            results.append((y, xr.grad, layer.weight.grad))
            if not general:
                (plan,) = linear_plans.plans.values()
                assert all(isinstance(mm, _cublaslt.ScaledMM)
                           for mm in (plan.mm_fwd, plan.mm_dgrad, plan.mm_wgrad)), \
                    _cublaslt.refusals
    for got, want in zip(*results):
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.gpu
def test_a_refused_signature_frees_its_descriptors(monkeypatch):
    monkeypatch.setattr(_cublaslt, "enabled", True)
    dev = torch.device("cuda", 0)
    args = (512, 512, 512, E4M3, E4M3, "128x128", torch.bfloat16, dev)
    assert _cublaslt.make(*args) is not None        # (loads the library; freed at once)
    lib = _cublaslt._lib[0]
    freed = []
    monkeypatch.setattr(lib, "cublasLtMatmulAlgoGetHeuristic", lambda *a: 7)
    for name in ("cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy",
                 "cublasLtMatmulPreferenceDestroy"):
        monkeypatch.setattr(lib, name, lambda obj, real=getattr(lib, name), name=name:
                            freed.append(name) or real(obj))
    assert _cublaslt.make(*args) is None
    assert _cublaslt.refusals[-1].startswith("heuristic: status 7")
    assert sorted(freed) == ["cublasLtMatmulDescDestroy", "cublasLtMatmulPreferenceDestroy"] \
        + ["cublasLtMatrixLayoutDestroy"] * 3


def test_signatures_it_does_not_serve(monkeypatch):
    monkeypatch.setattr(_cublaslt, "enabled", True)
    dev = torch.device("cuda", 0)
    assert _cublaslt.make(512, 512, 512, E4M3, E4M3, "128x128", torch.float64, dev) is None
    assert _cublaslt.make(512, 512, 512, E4M3, E4M3, "1x32", torch.bfloat16, dev) is None
    assert _cublaslt.make(512, 512, 500, E4M3, E4M3, "1x128", torch.bfloat16, dev) is None
    assert _cublaslt.make(512, 512, 512, torch.uint8, E4M3, "1x128", torch.bfloat16,
                          dev) is None
    monkeypatch.setattr(_cublaslt, "enabled", False)
    assert _cublaslt.make(512, 512, 512, E4M3, E4M3, "128x128", torch.bfloat16, dev) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_none_without_cublaslt(monkeypatch):
    """torch without CUDA loads no libcublasLt: the Linear keeps torch's path."""
    monkeypatch.setattr(_cublaslt, "enabled", True)
    assert _cublaslt.make(512, 512, 512, E4M3, E4M3, "128x128", torch.bfloat16,
                          torch.device("cuda", 0)) is None
