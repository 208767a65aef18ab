"""Which scale layouts does cuBLASLt's blockwise FP8 GEMM read when the K-block count is not a
multiple of 4? torch._scaled_mm rejects such K, and fp8blk pads the operands' data to a
multiple of 512 columns (a copy of both operands per GEMM, fp8blk/torch/scaled_mm.py).
Through fp8blk's direct cuBLASLt call (no torch checks) each candidate layout of the scales
is tried against an fp32 reference of the same FP8 data; scales are random powers of two
(2^-8..2^8) per block, so a layout read wrongly shows as a large error.

torch's operands: a (M, K) row-major with 1x128 scales; b (N, K) row-major (torch's
column-major (K, N)) with 128x128 or 1x128 scales. Candidates for b's 128x128 scales
(nt = cdiv(N, 128), kt = cdiv(K, 128)): "nt,kt" (K-blocks contiguous, ld kt), "nt,kt4"
(ld round4(kt): fp8blk's Block2D layout), "kt,nt", "kt,nt4". For 1x128 scales of an (R, K)
operand: "kt,R" (rows contiguous, ld R), "kt,R4" (ld round4(R): fp8blk's Block1D layout) and
"R,kt".

    python3 -m bench.profile.probe_cublaslt_kblocks
"""
import torch

from fp8blk.torch import _cublaslt

DEV = torch.device("cuda", 0)
F8 = torch.float8_e4m3fn


def cdiv(a, b):
    return -(-a // b)


def pow2(shape, gen):
    return torch.exp2(torch.randint(-8, 9, shape, generator=gen, device=DEV).float())


def buffer(logical, layout):
    """`logical` (rows, cols) scales stored as `layout` ("r,c", "r,c4", "c,r", "c,r4")."""
    r, c = logical.shape
    t = logical.t() if layout.startswith("c") else logical
    pad = layout.endswith("4")
    out = torch.full((t.shape[0], cdiv(t.shape[1], 4) * 4 if pad else t.shape[1]), 1e30,
                     device=DEV)
    out[:, : t.shape[1]] = t
    return out


def case(m, n, k, b_blocks, gen):
    kt, nt = cdiv(k, 128), cdiv(n, 128)
    a = (torch.randn(m, k, generator=gen, device=DEV) * 50).to(F8)
    b = (torch.randn(n, k, generator=gen, device=DEV) * 50).to(F8)
    sa = pow2((m, kt), gen)
    sb = pow2((nt, kt) if b_blocks == "128x128" else (n, kt), gen)
    a32 = a.float() * sa.repeat_interleave(128, 1)[:, :k]
    sbe = sb.repeat_interleave(128, 1)[:, :k]
    if b_blocks == "128x128":
        sbe = sbe.repeat_interleave(128, 0)[:n]
    ref = a32 @ (b.float() * sbe).t()
    try:   # _make: make() itself declines K % 128 != 0, which this probe tries
        mm = _cublaslt._make(m, n, k, F8, F8, b_blocks, DEV)
    except RuntimeError as err:
        mm = None
        _cublaslt.refusals.append(str(err))
    if mm is None:
        print(f"  M={m} N={n} K={k} (kt={kt}) b {b_blocks}: no algorithm "
              f"({_cublaslt.refusals[-1:]})")
        return
    sa_layouts = {"kt,M": buffer(sa, "c,r"), "kt,M4": buffer(sa, "c,r4"),
                  "M,kt": buffer(sa, "r,c")}
    if b_blocks == "128x128":
        sb_layouts = {name: buffer(sb, lay) for name, lay in
                      (("nt,kt", "r,c"), ("nt,kt4", "r,c4"), ("kt,nt", "c,r"),
                       ("kt,nt4", "c,r4"))}
    else:
        sb_layouts = {"kt,N": buffer(sb, "c,r"), "kt,N4": buffer(sb, "c,r4"),
                      "N,kt": buffer(sb, "r,c")}
    scale = ref.abs().max().item()
    res = []
    for na, bufa in sa_layouts.items():
        for nb, bufb in sb_layouts.items():
            out = mm(a, b.t(), bufa, bufb)
            torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / scale).item()
            res.append(f"a {na} b {nb}: {err:.1e}{' OK' if err < 1e-2 else ''}")
    print(f"  M={m} N={n} K={k} (kt={kt}) b {b_blocks}: " + "; ".join(res), flush=True)


def main():
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"cuBLASLt {_cublaslt._library(DEV)}")
    for b_blocks in ("128x128", "1x128"):
        for m, n, k in ((256, 384, 512), (256, 384, 384), (256, 384, 640), (256, 384, 768),
                        (256, 384, 1152), (256, 320, 384), (512, 256, 1408)):
            case(m, n, k, b_blocks, gen)
    # K not a multiple of 128 (a partial last K-block: the weight gradient's K is the token
    # count), and row counts that are not multiples of 4 (the 1x128 scales' padded stride)
    for b_blocks in ("128x128", "1x128"):
        for m, n, k in ((256, 384, 336), (256, 384, 8000), (512, 256, 4016), (258, 384, 512),
                        (262, 260, 384), (8000, 4096, 4096)):
            case(m, n, k, b_blocks, gen)


if __name__ == "__main__":
    main()
