"""The builder of the experts' m-grouped GEMM kernel (``grouped_gemm`` launches it): every
expert's ``y[seg_e] = dequant(a[seg_e]) @ dequant(b_e).T`` in one launch, a 1x128-scaled
(rows, K) e4m3 operand against per-expert 128x128-scaled e4m3 weights, bf16 out, for the
padded token layout whose 128-row tiles each belong to one expert (``tile_expert``, one
int32 per row tile, read on the device: no host synchronization).

``weights_kernel_fn`` is the k-grouped twin for the weight gradients (``out[e] = a_t[:, seg_e]
@ b_t[:, seg_e].T``, both operands 128x1-scaled per block of 128 tokens, so the promotion
scales each element by its row's and its column's scale), walking each expert's segment as
read from the device.

Structure (DeepGEMM's and CUTLASS's warp-specialized Hopper GEMMs; ``_hopper`` has the
instructions): 384 threads, one CTA per multiprocessor walking the 128 x 128 output tiles in a
grouped raster order (GROUP row tiles by every column tile, row tiles fastest, so that the
tiles the running CTAs read stay in L2).

- Warpgroup 0 produces: one thread issues, per 128-deep block of K, two 2-D tensor copies (the
  A tile, 128 rows x 128 bytes, and the expert's B tile, both 128-byte swizzled) and a bulk
  copy of the A tile's 128 row scales of that block, into a ring of STAGES stages. Each stage
  has a "full" barrier (the copies' bytes arrive) and an "empty" barrier (the 8 math warps
  have read it).
- Warpgroups 1 and 2 compute 64 rows x 128 columns each: per block four wgmma m64n128k32 into
  a fresh fp32 partial, then ``final += part * (sa[row, kb] * sb_e[tile, kb])`` -- the
  promotion cuBLASLt applies to 1x128 x 128x128 operands, in the same order, so the outputs
  are its bytes where it sums as it does. The two warpgroups run unsynchronized: one's
  promotion overlaps the other's tensor-core work.
- Epilogue: each math warpgroup packs its tile to bf16 (round to nearest even), stores it to
  shared memory with ``stmatrix`` in two 64-row boxes of 128-byte rows, in the copy engine's
  128-byte swizzle (no bank conflicts), and its leader issues two bulk tensor stores through
  C's tensor map without waiting for them: the warpgroup goes on to its next tile while they
  run, and waits only before writing its boxes again. The producer is already loading the
  next tile. A tile past the last segment (``tile_expert >= E``) is written as zeros.

B is addressed through one tensor map over all experts: ``b_by_columns = 0`` for (E, N, K)
weights stacked along rows (expert e's tile at row e*N + n0), 1 for the transposed weights
read in place, side by side along columns (expert e's (N, K) at column e*K of an (N, E*K)
matrix). Needs K and N multiples of 128; the launcher checks the rest.
"""
from __future__ import annotations

import numpy as np

from . import _hopper as hp
from ._numba import cuda, device, ptr, types

STAGES = 5
GROUP = 8
THREADS = 384               # producer warpgroup + two math warpgroups
MATH_WARPS = 8
TILE_BYTES = 16384          # 128 rows x 128 bytes
STAGE_BYTES = 2 * TILE_BYTES
SCALE_BYTES = 512           # the A tile's 128 row scales of one block
STAGE_OUT = 16384           # one math warpgroup's staged 64 x 128 bf16: two 64 x 128-byte boxes
SMEM_BYTES = STAGES * (STAGE_BYTES + SCALE_BYTES) + 1024 + 2 * STAGES * 8 + 2 * STAGE_OUT
# descriptor high bits: stride byte offset 1024 (8 swizzled rows of 128 bytes), leading byte
# offset unused in K-major swizzled mode (1), layout type 1 = 128-byte swizzle
_DESC_HI = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)

MAP_WORDS = types.UniTuple(types.uint64, 48)   # A's, B's and C's CUtensorMap, 16 words each
WS_WORDS = 64               # per CTA: A's and B's maps, then C's once per math warpgroup
ARGTYPES = [ptr(types.uint64), MAP_WORDS, ptr(types.float32), ptr(types.float32),
            ptr(types.int32)] + [types.int64] * 8


@device
def _init_barriers(bars, tid):
    """full[s] at bars + 8 s (one arrival: the producer's, plus the copies' bytes), empty[s]
    at bars + 8 (STAGES + s) (one arrival per math warp)."""
    if tid == 0:
        for s in range(STAGES):
            hp.mbar_init(np.uint32(bars + 8 * s), np.uint32(1))
            hp.mbar_init(np.uint32(bars + 8 * (STAGES + s)), np.uint32(MATH_WARPS))
        hp.fence_mbarrier_init()
    cuda.syncthreads()


@device
def _maps_here(ws, words):
    """The producer thread's copy of A's and B's tensor maps (kernel arguments, so a launch
    needs no host-to-device copy and a CUDA graph captures them by value) in this CTA's words
    of the global workspace ``ws``, made visible to the copy engine's tensor-map reads."""
    at = np.int64(cuda.blockIdx.x) * WS_WORDS
    for i in range(32):
        ws[at + i] = words[i]
    hp.tensormap_release()
    hp.tensormap_acquire(ws, at)
    hp.tensormap_acquire(ws, at + 16)
    return at


@device
def _out_map_here(ws, words, mw):
    """A math warpgroup leader's copy of C's tensor map (its bulk stores read it), as
    :func:`_maps_here`; returns its word offset in ``ws``."""
    at = np.int64(cuda.blockIdx.x) * WS_WORDS + 32 + 16 * mw
    for i in range(16):
        ws[at + i] = words[32 + i]
    hp.tensormap_release()
    hp.tensormap_acquire(ws, at)
    return at


@device
def _raster(pid, rows, cols):
    """Tile pid's (row tile, column tile) of a rows x cols grid in the grouped order: GROUP row
    tiles by every column tile, row tiles fastest (the running CTAs share their A and B tiles
    in L2)."""
    first = (pid // (GROUP * cols)) * GROUP
    size = min(rows - first, GROUP)
    return first + (pid % (GROUP * cols)) % size, (pid % (GROUP * cols)) // size


@device
def _next(s, phase):
    """The ring's next stage; the barriers' phase parity flips at each wrap."""
    s += 1
    if s == STAGES:
        return 0, phase ^ 1
    return s, phase


@device
def _fill_begin(bars, s, phase, tx_bytes):
    """The producer: wait until the math warps have released stage s, announce its copies'
    bytes; returns the stage's "full" barrier for the copies to complete on."""
    while hp.mbar_try_wait(np.uint32(bars + 8 * (STAGES + s)), phase ^ 1) == 0:
        pass
    full = np.uint32(bars + 8 * s)
    hp.mbar_arrive_tx(full, np.uint32(tx_bytes))
    return full


@device
def _math_lane(tid, staging):
    """A math thread's place: (warpgroup 0/1, thread in it, lane, its first accumulator row,
    its stmatrix row address in the first staging box, its warpgroup's staging boxes)."""
    mw = tid // 128 - 1
    t = tid % 128
    lane = t % 32
    mine = staging + mw * STAGE_OUT
    st_row = (t // 32) * 16 + lane % 8 + 8 * ((lane // 8) % 2)   # stmatrix's row address
    return (mw, t, lane, (t // 32) * 16 + lane // 4, np.uint32(mine + st_row * 128), mine)


@device
def _mma_begin(part, bars, base, s, phase, mw):
    """Wait for stage s, issue the warpgroup's four wgmma of it into a fresh partial (its 64
    rows of the A tile against the B tile, descriptors in 128-byte swizzle mode)."""
    while hp.mbar_try_wait(np.uint32(bars + 8 * s), phase) == 0:
        pass
    sbase = base + s * STAGE_BYTES
    hi = np.uint64(_DESC_HI)
    da = np.uint64(((sbase + mw * 8192) & 0x3FFFF) >> 4) | hi
    db = np.uint64(((sbase + TILE_BYTES) & 0x3FFFF) >> 4) | hi
    hp.wgmma_fence()
    part = hp.mma_block(part, da, db)
    hp.wgmma_commit()
    return part


@device
def _wg_sync(mw):
    if mw == 0:
        hp.bar_sync_wg1()
    else:
        hp.bar_sync_wg2()


@device
def _store_tile(final, mw, t, lane, st_addr, mine, ws, c_at, row, col_bytes):
    """A math warpgroup's 64 x 128 tile to C's rows [row, row + 64), bytes [col_bytes,
    col_bytes + 256): bf16 into its two staging boxes (stmatrix, swizzled), then two bulk
    tensor stores that the leader issues and does not wait for -- they run while the
    warpgroup computes its next tile; the leader waits only before the boxes are written
    again."""
    if t == 0:                           # the last tile's boxes have been read
        hp.bulk_wait_read()
    _wg_sync(mw)
    hp.stmatrix_swizzled(st_addr, lane % 8, lane // 16, final)
    hp.fence_proxy_async()               # stmatrix's writes, visible to the copy engine
    _wg_sync(mw)
    if t == 0:
        hp.tma_store_2d(np.uint32(mine), ws, c_at, col_bytes, row)
        hp.tma_store_2d(np.uint32(mine + 8192), ws, c_at, col_bytes + 128, row)
        hp.bulk_commit()


def kernel_fn(ws, map_words, sa, sb, tile_expert, rows, n, k, experts, sa_stride,
              sb_expert, sb_tile, b_by_columns):
    """ws: WS_WORDS words of global workspace per CTA; map_words: the tensor maps of a, b and
    the output c ((rows, n) bf16 as bytes, 64-row boxes); sa (K/128 rows of sa_stride) fp32:
    a's 1x128 scales; sb fp32: expert e's scale of (row tile t, block kb) at
    e * sb_expert + t * sb_tile + kb."""
    smem = cuda.shared.array(0, types.uint8)
    tid = cuda.threadIdx.x
    raw = np.int64(hp.shared_base(smem))
    base = ((raw + 1023) // 1024) * 1024         # the swizzle pattern repeats every 1024 bytes
    staging = base + STAGES * STAGE_BYTES        # 1024-aligned: the swizzled boxes
    scales = staging + 2 * STAGE_OUT
    bars = scales + STAGES * SCALE_BYTES          # full[s] at +8 s, empty[s] at +8 (STAGES + s)
    _init_barriers(bars, tid)
    n_tiles = n // 128
    m_tiles = rows // 128
    kb_count = k // 128
    s = 0
    phase = 0
    if tid < 128:
        hp.setmaxnreg_producer()
        if tid == 0:
            at = _maps_here(ws, map_words)      # A's map at ws + at, B's at ws + at + 16
            for pid in range(cuda.blockIdx.x, n_tiles * m_tiles, cuda.gridDim.x):
                mt, nt = _raster(pid, m_tiles, n_tiles)
                e = np.int64(tile_expert[mt])
                if e >= experts:
                    continue
                b_col = b_by_columns * e * k
                b_row = nt * 128 + (1 - b_by_columns) * e * n
                for kb in range(kb_count):
                    full = _fill_begin(bars, s, phase, STAGE_BYTES + SCALE_BYTES)
                    dst = base + s * STAGE_BYTES
                    hp.tma_load_2d(np.uint32(dst), ws, at, kb * 128, mt * 128, full)
                    hp.tma_load_2d(np.uint32(dst + TILE_BYTES), ws, at + 16, b_col + kb * 128,
                                   b_row, full)
                    hp.bulk_load(np.uint32(scales + s * SCALE_BYTES), sa,
                                 np.int64(kb) * sa_stride + mt * 128, np.uint32(SCALE_BYTES), full)
                    s, phase = _next(s, phase)
    else:
        hp.setmaxnreg_math()
        mw, t, lane, row0, st_addr, mine = _math_lane(tid, staging)
        c_at = _out_map_here(ws, map_words, mw) if t == 0 else np.int64(0)
        for pid in range(cuda.blockIdx.x, n_tiles * m_tiles, cuda.gridDim.x):
            mt, nt = _raster(pid, m_tiles, n_tiles)
            e = np.int64(tile_expert[mt])
            final = hp.acc_zeros()
            if e < experts:
                part = hp.acc_zeros()
                sb_row = e * sb_expert + nt * sb_tile
                sbk = sb[sb_row]
                for kb in range(kb_count):
                    part = _mma_begin(part, bars, base, s, phase, mw)
                    srow = scales + s * SCALE_BYTES + (mw * 64 + row0) * 4
                    r0 = hp.ld_shared_f32(np.uint32(srow)) * sbk
                    r1 = hp.ld_shared_f32(np.uint32(srow + 32)) * sbk
                    if kb + 1 < kb_count:                # the next block's B scale, early
                        sbk = sb[sb_row + kb + 1]
                    part = hp.wgmma_wait0(part)
                    if lane == 0:
                        hp.mbar_arrive(np.uint32(bars + 8 * (STAGES + s)))
                    final = hp.promote_rows(final, part, r0, r1)
                    s, phase = _next(s, phase)
            _store_tile(final, mw, t, lane, st_addr, mine, ws, c_at, mt * 128 + mw * 64,
                        nt * 256)
        if t == 0:                               # the stores complete before the kernel ends
            hp.bulk_wait()


# ---- the k-grouped GEMM: the experts' weight gradients ----------------------------------------

W_SCALE_BYTES = 1024        # a block's 128 row scales of A and 128 of B
W_SMEM_BYTES = STAGES * (STAGE_BYTES + W_SCALE_BYTES) + 1024 + 2 * STAGES * 8 + 2 * STAGE_OUT
W_ARGTYPES = [ptr(types.uint64), MAP_WORDS, ptr(types.float32), ptr(types.float32),
              ptr(types.int64), ptr(types.int64)] + [types.int64] * 5


def weights_kernel_fn(ws, map_words, sa, sb, starts, padded, n, k, experts, sa_stride,
                      sb_stride):
    """out[e] (n, k) = a_t[:, seg_e] @ b_t[:, seg_e].T for every expert: a_t (n, rows) and b_t
    (k, rows) e4m3 through their tensor maps (tokens contiguous), their 128x1 scales sa (rows/128
    rows of sa_stride) and sb (of sb_stride) fp32; starts / padded (E,) int64 each segment's
    first row and length (multiples of 128) on the device; the output c (E, n, k) bf16 through
    the third tensor map (an (E*n, 2k)-byte matrix), zeros for an empty expert. Per 128-token
    block: final += part * (sa[row] * sb[col])."""
    smem = cuda.shared.array(0, types.uint8)
    tid = cuda.threadIdx.x
    raw = np.int64(hp.shared_base(smem))
    base = ((raw + 1023) // 1024) * 1024
    staging = base + STAGES * STAGE_BYTES
    scales = staging + 2 * STAGE_OUT
    bars = scales + STAGES * W_SCALE_BYTES
    _init_barriers(bars, tid)
    n_tiles = n // 128
    k_tiles = k // 128
    per_expert = n_tiles * k_tiles
    s = 0
    phase = 0
    if tid < 128:
        hp.setmaxnreg_producer()
        if tid == 0:
            at = _maps_here(ws, map_words)
            for pid in range(cuda.blockIdx.x, experts * per_expert, cuda.gridDim.x):
                e = pid // per_expert
                nt, ct = _raster(pid % per_expert, n_tiles, k_tiles)
                tb0 = starts[e] // 128
                for i in range(padded[e] // 128):
                    tb = tb0 + i
                    full = _fill_begin(bars, s, phase, STAGE_BYTES + W_SCALE_BYTES)
                    dst = base + s * STAGE_BYTES
                    hp.tma_load_2d(np.uint32(dst), ws, at, tb * 128, nt * 128, full)
                    hp.tma_load_2d(np.uint32(dst + TILE_BYTES), ws, at + 16, tb * 128,
                                   ct * 128, full)
                    sdst = scales + s * W_SCALE_BYTES
                    hp.bulk_load(np.uint32(sdst), sa, tb * sa_stride + nt * 128, np.uint32(512),
                                 full)
                    hp.bulk_load(np.uint32(sdst + 512), sb, tb * sb_stride + ct * 128,
                                 np.uint32(512), full)
                    s, phase = _next(s, phase)
    else:
        hp.setmaxnreg_math()
        mw, t, lane, row0, st_addr, mine = _math_lane(tid, staging)
        c_at = _out_map_here(ws, map_words, mw) if t == 0 else np.int64(0)
        col = 2 * (lane % 4)
        for pid in range(cuda.blockIdx.x, experts * per_expert, cuda.gridDim.x):
            e = pid // per_expert
            nt, ct = _raster(pid % per_expert, n_tiles, k_tiles)
            final = hp.acc_zeros()
            part = hp.acc_zeros()
            for i in range(padded[e] // 128):
                part = _mma_begin(part, bars, base, s, phase, mw)
                sdst = scales + s * W_SCALE_BYTES
                r0 = hp.ld_shared_f32(np.uint32(sdst + (mw * 64 + row0) * 4))
                r1 = hp.ld_shared_f32(np.uint32(sdst + (mw * 64 + row0 + 8) * 4))
                part = hp.wgmma_wait0(part)
                final = hp.promote_rows_cols(final, part, r0, r1,
                                             np.uint32(sdst + 512 + col * 4))
                if lane == 0:                    # the column scales are read: release
                    hp.mbar_arrive(np.uint32(bars + 8 * (STAGES + s)))
                s, phase = _next(s, phase)
            _store_tile(final, mw, t, lane, st_addr, mine, ws, c_at,
                        e * n + nt * 128 + mw * 64, ct * 256)
        if t == 0:
            hp.bulk_wait()
