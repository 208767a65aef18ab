"""ZeRO-style FP8 weight pipeline on N ranks, checked against one rank doing it all.

    mpiexec -n 4 python -m mpi4py examples/weights_pipeline.py            # CPU: MPI, NumPy
    mpiexec -n 2 python -m mpi4py examples/weights_pipeline.py --large    # GPUs: NCCL, CuPy

What a data-parallel step with FP8 weights does, phase by phase:

1. master  Each rank keeps an fp32 *master* shard of a two-layer MLP's weights W1 (F, D) and
           W2 (D, F): the weights are laid end to end in one flat buffer and every rank owns one
           contiguous piece of it, cut at arbitrary offsets (inside rows and 128x128 tiles).
2. cast    ``fb.cast_master_weights`` turns each rank's shard into its FP8 bytes (Block2D,
           128x128 tiles) with ONE packed all-reduce of tile amaxes for both weights; every rank
           then holds the complete scales, and the FP8 bytes of its own piece.
3. gather  ``fb.comm.gather_along_first_dim`` all-gathers the flat FP8 byte buffer: 1 byte per
           element on the wire instead of bf16's 2.
4. transp  ``BlockTensor.create_columnwise``: the (K, N) columnwise copy of each weight, by a
           local FP8 transpose (no second quantization, no extra communication).
5. gemm    forward ``y = relu(x W1^T) W2^T`` and the input gradient ``dh = dy W2`` on this rank's
           tokens, as blockwise FP8 GEMMs: activations 1x128 (Block1D), weights 128x128.
           On the CPU (or a GPU without torch) the GEMM is exact emulation: decode FP8, multiply
           by the block scales, fp32 matmul; on a GPU with torch, ``torch._scaled_mm`` through
           ``fp8blk.torch.blockwise_scaled_mm``.

Checks (every rank; the script exits 1 on any mismatch): the gathered FP8 weights and their
transposes equal ``fb.quantize(bf16(full master weight))`` computed on one rank by the NumPy
reference, byte for byte; the three GEMM outputs equal the same GEMMs run on those single-rank
operands, exactly. The FP8 GEMM's error against an fp32 GEMM of the unquantized data is printed.

Backends: ``--backend auto`` takes NCCL with CuPy arrays when every rank has a GPU of its own,
else MPI with NumPy arrays (``--backend mpi`` / ``nccl`` force one).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import fp8blk as fb

BF16 = np.dtype(ml_dtypes.bfloat16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=512, help="D (default 512)")
    p.add_argument("--d-ff", type=int, default=1536, help="F (default 1536)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank (default 256)")
    p.add_argument("--large", action="store_true",
                   help="GPU sizes: D=4096, F=14336, 4096 tokens per rank")
    p.add_argument("--steps", type=int, default=3,
                   help="pipeline repetitions; times are the median after the first (default 3)")
    p.add_argument("--backend", choices=("auto", "mpi", "nccl"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.large:
        args.d_model, args.d_ff, args.tokens = 4096, 14336, 4096
    return args


# -- backends ------------------------------------------------------------------------------


def choose_backend(mpi_comm, name):
    """(fp8blk communicator, array module). All ranks take the same choice."""
    cupy = None
    if name != "mpi":
        local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this node
        ranks_here = local.Get_size()
        local.Free()
        try:
            import cupy

            enough = cupy.cuda.runtime.getDeviceCount() >= ranks_here
        except Exception:  # no CuPy, no driver, no device
            cupy, enough = None, False
        enough = mpi_comm.allreduce(enough, op=MPI.LAND)
        if name == "nccl" and not enough:
            raise SystemExit("--backend nccl needs CuPy and one GPU per rank")
        if not enough:
            cupy = None
    if cupy is None:
        return fb.comm.MPIComm(mpi_comm), np
    return fb.comm.NCCLComm.from_mpi(mpi_comm), cupy


def synchronize(xp, comm):
    """Wait for the device (if any), then for every rank: phase times are wall times of all."""
    if xp is not np:
        xp.cuda.Device().synchronize()
    comm.barrier()


# -- blockwise FP8 GEMM ------------------------------------------------------------------------

# The float32 value of every E4M3 byte: decoding is a table lookup, in NumPy and CuPy alike.
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _expand(scales, rows, cols, row_block, col_block):
    """Per-element (rows, cols) scales from one value per (row_block x col_block) block."""
    return scales.repeat(row_block, axis=0).repeat(col_block, axis=1)[:rows, :cols]


def gemm_emulated(xp, a_data, a_sinv, b_data, b_sinv):
    """C = A B^T in fp32, exactly what a blockwise-scaled FP8 GEMM computes before rounding.

    ``a_data`` uint8 (M, K) E4M3 with 1x128 scales ``a_sinv`` fp32 (cdiv(K,128), round4(M)),
    entry [kb, m] (Block1D rowwise); ``b_data`` uint8 (N, K) with 128x128 scales ``b_sinv``
    fp32 (cdiv(N,128), round4(cdiv(K,128))) (Block2D rowwise). Returns fp32 (M, N).
    """
    (m, k), n = a_data.shape, b_data.shape[0]
    lut = xp.asarray(E4M3_VALUES)
    a = lut[a_data] * _expand(a_sinv[:, :m].T, m, k, 1, 128)
    b = lut[b_data] * _expand(b_sinv, n, k, 128, 128)
    return a @ b.T


def make_gemm(xp):
    """The GEMM to use: on a GPU with torch, ``fp8blk.torch.blockwise_scaled_mm`` (or
    ``torch._scaled_mm`` directly where fp8blk.torch is absent); else the emulation. Same
    arguments as gemm_emulated; returns fp32, or bf16 bit patterns (uint16) from torch."""
    if xp is np:
        return gemm_emulated, "emulated (decode FP8 x block scales, fp32 matmul)"
    try:
        import torch
    except ImportError:
        return (lambda *a: gemm_emulated(xp, *a)), "emulated on the GPU (CuPy; no torch)"

    f8 = torch.float8_e4m3fn
    t = torch.from_dlpack
    try:
        from fp8blk.torch import blockwise_scaled_mm
    except ImportError:
        blockwise_scaled_mm = None

    def scaled_mm(_, a_data, a_sinv, b_data, b_sinv):
        if blockwise_scaled_mm is not None:  # checks the layouts; pads K where torch needs it
            out = blockwise_scaled_mm(t(a_data).view(f8), t(a_sinv), t(b_data).view(f8),
                                      t(b_sinv), "1x128", "128x128", torch.bfloat16)
        else:
            # fp8blk's buffers feed torch._scaled_mm with no copy (docs/torch.md): A scales
            # (M, K/128) column-major = our (K/128, M) read transposed; B scales 128x128,
            # K-major, K-block count padded to a multiple of 4 -- which is our layout already.
            m, k = a_data.shape
            out = torch._scaled_mm(t(a_data).view(f8), t(b_data).view(f8).t(),
                                   t(a_sinv)[:, :m].t(), t(b_sinv)[:, :-(-k // 128)].t(),
                                   out_dtype=torch.bfloat16)
        return xp.from_dlpack(out.view(torch.int16)).view(np.uint16)  # bf16 bits in CuPy
    name = ("fp8blk.torch.blockwise_scaled_mm" if blockwise_scaled_mm is not None
            else "torch._scaled_mm") + " (blockwise FP8 on the GPU, bf16 out)"
    return scaled_mm, name


# -- data --------------------------------------------------------------------------------------


def full_weights(args):
    """The unsharded fp32 masters W1 (F, D), W2 (D, F), identical on every rank (same seed).
    Rows span four orders of magnitude, so 128x128 tiles get different scales."""
    rng = np.random.default_rng(args.seed)
    out = []
    for shape in ((args.d_ff, args.d_model), (args.d_model, args.d_ff)):
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= np.exp(rng.uniform(-4.5, 4.5, size=(shape[0], 1))).astype(np.float32) * 0.02
        out.append(w)
    return out


def zero_cuts(total, size, seed):
    """ZeRO-style ownership of a flat buffer of `total` elements: rank r owns
    [cuts[r], cuts[r+1]). Near-even pieces, each cut moved by a random amount so that cuts
    land inside rows and tiles."""
    rng = np.random.default_rng(seed + 1)
    even = np.linspace(0, total, size + 1)
    jitter = rng.uniform(-0.3, 0.3, size=size + 1) * total / size
    jitter[[0, -1]] = 0
    return np.round(even + jitter).astype(np.int64)


def tokens(args, rank, shape_cols, salt):
    """This rank's activations (or output gradients): rows and columns span orders of
    magnitude. bf16, as a training step holds them."""
    rng = np.random.default_rng([args.seed, rank, salt])
    x = rng.standard_normal((args.tokens, shape_cols), dtype=np.float32)
    x *= np.exp(rng.uniform(-3, 3, size=(args.tokens, 1))).astype(np.float32)
    x *= np.exp(rng.uniform(-1, 1, size=(1, shape_cols))).astype(np.float32)
    return x.astype(BF16)


# -- the pipeline ------------------------------------------------------------------------------


def pipeline(comm, xp, shapes, masters, offsets, cuts, gemm, x_local, dy_local):
    """One step; returns (weights, outputs, {phase: seconds}, {phase: bytes sent by this rank})."""
    recipe = fb.Block2D()
    times, wire = {}, {}
    lo, hi = int(cuts[comm.rank]), int(cuts[comm.rank + 1])

    def phase(name, fn):
        synchronize(xp, comm)
        comm.reset_stats()
        start = time.perf_counter()
        result = fn()
        synchronize(xp, comm)
        times[name] = time.perf_counter() - start
        wire[name] = comm.stats.bytes
        return result

    # FP8 storage of each weight (rowwise + its scales) and the rank's flat FP8 piece
    weights = [fb.quantize(xp.zeros(s, np.float32), recipe, rowwise=True) for s in shapes]
    piece = xp.empty(hi - lo, np.uint8)
    fragments, start = [], 0  # start: the weight's first element in the flat buffer
    for s, m, o in zip(shapes, masters, offsets):
        n = 0 if m is None else m.size
        fragments.append(piece[start + o - lo:start + o - lo + n] if n else None)
        start += s[0] * s[1]
    phase("cast", lambda: fb.cast_master_weights(weights, masters, offsets, comm,
                                                 fragments=fragments))
    # no recipe: the ranks' (already FP8) pieces are concatenated into the whole flat buffer
    flat, _ = phase("gather", lambda: fb.comm.gather_along_first_dim(piece, comm))

    def unpack_and_transpose():
        start = 0
        for w, s in zip(weights, shapes):
            w.rowwise_data[...] = flat[start:start + s[0] * s[1]].reshape(s)
            start += s[0] * s[1]
            w.create_columnwise()
    phase("transpose", unpack_and_transpose)

    def forward_backward():
        return run_gemms(xp, gemm, x_local, dy_local, weights)
    outputs = phase("gemm", forward_backward)
    return weights, outputs, times, wire


def run_gemms(xp, gemm, x, dy, weights):
    """y = relu(x W1^T) W2^T and dh = dy W2 with FP8 operands; returns the three products."""
    w1, w2 = weights
    qx = fb.quantize(x, fb.Block1D())
    h = gemm(xp, qx.rowwise_data, qx.rowwise_scale_inv, w1.rowwise_data, w1.rowwise_scale_inv)
    h = to_high_precision(xp, h)
    qh = fb.quantize(xp.maximum(h, 0), fb.Block1D())
    y = gemm(xp, qh.rowwise_data, qh.rowwise_scale_inv, w2.rowwise_data, w2.rowwise_scale_inv)
    qdy = fb.quantize(dy, fb.Block1D())
    # dh = dy W2: W2's columnwise buffers are the rowwise buffers of W2^T (F, D), 128x128 tiles
    dh = gemm(xp, qdy.rowwise_data, qdy.rowwise_scale_inv, w2.columnwise_data,
              w2.columnwise_scale_inv)
    return [h, to_high_precision(xp, y), to_high_precision(xp, dh)]


def to_high_precision(xp, out):
    """fp32 view of a GEMM result (bf16 bit patterns from torch._scaled_mm are widened)."""
    if out.dtype == np.uint16:
        return (out.astype(np.uint32) << 16).view(np.float32)
    return out


def host(xp, arr):
    return arr if xp is np else xp.asnumpy(arr)


def check(xp, gemm, full, weights, outputs, x_host, dy_host):
    """Every rank: its gathered weights and GEMM outputs against one rank's computation
    (``full``: the unsharded fp32 masters). Returns (problems, relative error vs fp32)."""
    problems = []
    refs = [fb.quantize(m.astype(BF16), fb.Block2D(), rowwise=True, columnwise=True)
            for m in full]
    for i, (w, ref) in enumerate(zip(weights, refs)):
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                     "columnwise_scale_inv"):
            if not np.array_equal(host(xp, getattr(w, name)), getattr(ref, name)):
                problems.append(f"W{i + 1}.{name} differs from quantize(bf16(full master))")
    # the same GEMMs on the single-rank operands, uploaded to the same device
    ref_weights = [fb.quantize(xp.zeros(r.shape, np.float32), fb.Block2D(), rowwise=True,
                               columnwise=True) for r in refs]
    for w, ref in zip(ref_weights, refs):
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                     "columnwise_scale_inv"):
            getattr(w, name)[...] = xp.asarray(getattr(ref, name))
    x, dy = xp.asarray(x_host), xp.asarray(dy_host)
    if xp is not np:  # CuPy has no bf16: hand the kernels float32 copies of the bf16 values
        x, dy = xp.asarray(x_host.astype(np.float32)), xp.asarray(dy_host.astype(np.float32))
    expected = run_gemms(xp, gemm, x, dy, ref_weights)
    for name, got, want in zip(("h = x W1^T", "y = relu(h) W2^T", "dh = dy W2"), outputs,
                               expected):
        if not np.array_equal(host(xp, got), host(xp, want)):
            diff = float(np.abs(host(xp, got) - host(xp, want)).max())
            problems.append(f"GEMM {name} differs from the single-rank GEMM (max |diff| {diff})")
    # how far FP8 is from fp32 on the unquantized data (information, not a check)
    x32, w1, w2 = x_host.astype(np.float32), full[0], full[1]
    y32 = np.maximum(x32 @ w1.T, 0) @ w2.T
    rel = np.linalg.norm(host(xp, outputs[1]) - y32) / np.linalg.norm(y32)
    return problems, rel


def main(argv=None):
    args = parse_args(argv)
    mpi = MPI.COMM_WORLD
    comm, xp = choose_backend(mpi, args.backend)
    gemm, gemm_name = make_gemm(xp)
    rank, size = comm.rank, comm.size
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    D, F, T = args.d_model, args.d_ff, args.tokens
    if gemm_name.startswith("torch._scaled_mm") and (D % 128 or F % 128):
        raise SystemExit("torch._scaled_mm needs D and F to be multiples of 128")

    full = full_weights(args)
    sizes = [w.size for w in full]
    cuts = zero_cuts(sum(sizes), size, args.seed)
    lo, hi = int(cuts[rank]), int(cuts[rank + 1])
    masters, offsets, start = [], [], 0
    for w in full:  # this rank's piece of each weight: [a, b) of the weight's flat indices
        a, b = max(lo - start, 0), min(hi - start, w.size)
        masters.append(xp.asarray(w.reshape(-1)[a:b]) if b > a else None)
        offsets.append(a if b > a else 0)
        start += w.size
    x_host, dy_host = tokens(args, rank, D, 0), tokens(args, rank, D, 1)
    x = xp.asarray(x_host) if xp is np else xp.asarray(x_host.astype(np.float32))
    dy = xp.asarray(dy_host) if xp is np else xp.asarray(dy_host.astype(np.float32))

    where = "NumPy on the CPU, MPI" if xp is np else "CuPy on the GPU, NCCL"
    say(f"weights pipeline: {size} ranks ({where}); W1 {F}x{D}, W2 {D}x{F} Block2D E4M3, "
        f"{T} tokens per rank; ZeRO cuts at flat offsets {list(map(int, cuts))}")
    say(f"GEMM: {gemm_name}")

    per_step = []
    for _ in range(max(args.steps, 1)):
        weights, outputs, times, wire = pipeline(comm, xp, [w.shape for w in full], masters,
                                                 offsets, cuts, gemm, x, dy)
        per_step.append(times)
    timed = per_step[1:] or per_step  # the first step includes kernel compilation
    median = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
    slowest = {k: mpi.allreduce(v, op=MPI.MAX) for k, v in median.items()}
    wire = {k: mpi.allreduce(v, op=MPI.MAX) for k, v in wire.items()}

    largest_piece = int(np.diff(cuts).max())
    bf16_bytes = {"cast": 0, "gather": 2 * largest_piece, "transpose": 0, "gemm": 0}
    notes = {"cast": "one packed all-reduce(MAX) of tile amaxes, both weights",
             "gather": "FP8 bytes of the flat buffer (bf16: 2 bytes per element)",
             "transpose": "local FP8 transpose, create_columnwise",
             "gemm": "3 blockwise FP8 GEMMs on this rank's tokens"}
    say(f"\n{'phase':<11}{'ms (slowest rank)':>18}{'bytes sent (max rank)':>23}"
        f"{'bf16 would send':>17}   what")
    for k in ("cast", "gather", "transpose", "gemm"):
        say(f"{k:<11}{slowest[k] * 1e3:>18.2f}{wire[k]:>23,}{bf16_bytes[k]:>17,}   {notes[k]}")
    total_fp8 = wire["cast"] + wire["gather"]
    say(f"{'total':<11}{sum(slowest.values()) * 1e3:>18.2f}{total_fp8:>23,}"
        f"{sum(bf16_bytes.values()):>17,}   FP8 sends {total_fp8 / bf16_bytes['gather']:.2f}x "
        f"the bytes of a bf16 weight all-gather")

    problems, rel = check(xp, gemm, full, weights, outputs, x_host, dy_host)
    for p in problems:
        print(f"rank {rank}: MISMATCH: {p}", flush=True)
    ok = mpi.allreduce(not problems, op=MPI.LAND)
    rel = mpi.allreduce(rel, op=MPI.MAX)
    say(f"\nFP8 MLP output vs fp32 on unquantized data: relative error {rel:.2e} (worst rank)")
    say("checks: gathered FP8 weights + transposes equal single-rank quantize byte for byte; "
        "GEMM outputs equal the single-rank GEMMs exactly: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
