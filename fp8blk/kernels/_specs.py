"""Numba-free definitions shared by the launchers and the kernel builders: input, output and
recipe kinds, each kernel family's spec (every value that changes generated code is a field,
so it is part of the variant's cache key), the launch geometry derived from a spec, the field
layout of the master-weight batch table, and :data:`SIM`. Hashed into every kernel's cache key.
Builders generate a kernel from its spec alone; launchers turn their settings into spec fields;
the module-level constants are structural (the kernels' index arithmetic assumes them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional


def simulator_on() -> bool:
    """Whether kernels run under Numba's CUDA simulator, read from the environment as Numba
    reads it (``NUMBA_ENABLE_CUDASIM``, an integer, non-zero = on) without importing numba:
    the launchers and the disk cache need it on the path that never imports numba (``_numba``
    checks that Numba agrees)."""
    value = os.environ.get("NUMBA_ENABLE_CUDASIM", "").strip()
    try:
        return int(value) != 0 if value else False
    except ValueError:  # Numba warns and uses its default (off)
        return False


SIM = simulator_on()

# ---- input kinds (quantize inputs, master-weight model dtypes) --------------------------------
F32, BF16, F16 = 0, 1, 2
ELEMS_PER_CHUNK = {F32: 4, BF16: 8, F16: 8}   # elements per 16-byte chunk
ITEMSIZE = {F32: 4, BF16: 2, F16: 2}
NAN_WORD = {F32: 0x7FC00000, BF16: 0x7FC07FC0, F16: 0x7E007E00}
NAN_HALF = {BF16: 0x7FC0, F16: 0x7E00}

# ---- recipe kinds -----------------------------------------------------------------------------
# a spec's recipe is the recipe's kind, ``fp8blk.formats.recipe_kind(recipe)`` (spelled here,
# not imported: a spec's module is hashed into every kernel's cache key and imports no fp8blk)
BLOCK1D, BLOCK2D, MXFP8 = "Block1D", "Block2D", "MXFP8"


# ---- quantize ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizeSpec:
    """One variant of the tiled quantize kernel (``_quantize_kernel``)."""

    recipe: str             # BLOCK1D | BLOCK2D | MXFP8
    kind: int               # F32 | BF16 | F16
    e4m3: bool
    rowwise: bool
    columnwise: bool
    pow2: bool              # fp32-scale recipes
    eps: float              # fp32-scale recipes
    vmax: float             # the input dtype's max (scale when F/amax overflows)
    vec: bool               # K % VE == 0 (16-byte loads, 8/4-byte stores along K)
    col_vec: bool           # M % 16 == 0 (16-byte stores of transposed bytes along M)
    threads: int = 256      # threads per CTA (a multiple of 32 that divides the tile's rows)
    min_blocks: Optional[int] = None   # min resident CTAs per SM asked of the register
    #                                    allocator (launch bound); None: the compiler's choice
    row_scatter: bool = True   # row amaxes: reduce-scatter over a block's lanes, so each lane
    #                            runs the scale rule once instead of once per chunk
    packed_amax: bool = True   # 2-byte inputs: amaxes with packed max.xorsign.abs.bf16x2 /
    #                            .f16x2 (one instruction per 2 elements) instead of fmaxf


@dataclass(frozen=True)
class QuantizeSettings:
    """Tuning of the quantize launcher (``quantize.use_settings``); resolved into spec fields.
    Defaults are the H200 sweep's choices (``bench/profile/sweep_fused.py``, its result in
    ``bench/profile/results/sweep-fused-h200.json``)."""

    # threads per CTA of the fused Block1D row+col kernel on 2-byte inputs: 512 halves the tile
    # each thread holds and avoids spills at 64 registers, but 256 threads with 3 CTAs per SM
    # (80 registers, a small spill outside the hot loop) measured faster (the sweep above)
    fused_block1d_threads: int = 256
    # threads per CTA of the Block2D rowwise-only kernel on 2-byte inputs
    block2d_row_threads: int = 256
    # min CTAs per SM for every variant; None: default_min_blocks
    min_blocks_per_sm: Optional[int] = None
    row_scatter: bool = True
    packed_amax: bool = True


def quantize_threads(recipe, kind, rowwise, columnwise, settings):
    """Threads per CTA of a quantize variant under `settings`."""
    if recipe == BLOCK1D and rowwise and columnwise and kind != F32:
        return settings.fused_block1d_threads
    if recipe == BLOCK2D and not columnwise and kind != F32:
        return settings.block2d_row_threads
    return 256


def default_min_blocks(recipe, kind, columnwise, threads):
    """Minimum CTAs per SM for the register allocator, chosen from the H200 sweep
    (``bench/profile/sweep_fused.py``; ``bench.bench_kernels`` times the variants): capping
    registers pays for the Block1D kernels with columnwise output."""
    if recipe == BLOCK1D and columnwise and kind != F32:
        # col only: 3 x 256 threads (80 registers); row+col: 3 CTAs at 256 threads (80
        # registers), 2 at 512 (64 registers)
        return 3 if threads == 256 else 1024 // threads
    return None


def quantize_spec(recipe, kind, e4m3, rowwise, columnwise, pow2, eps, vmax, vec, col_vec,
                  settings=QuantizeSettings()):
    """The QuantizeSpec of a call under `settings` (values normalized to exact key types)."""
    rowwise, columnwise = bool(rowwise), bool(columnwise)
    threads = quantize_threads(recipe, kind, rowwise, columnwise, settings)
    min_blocks = settings.min_blocks_per_sm
    if min_blocks is None:
        min_blocks = default_min_blocks(recipe, kind, columnwise, threads)
    return QuantizeSpec(recipe=recipe, kind=int(kind), e4m3=bool(e4m3), rowwise=rowwise,
                        columnwise=columnwise, pow2=bool(pow2), eps=float(eps),
                        vmax=float(vmax), vec=bool(vec), col_vec=bool(col_vec),
                        threads=int(threads), min_blocks=min_blocks,
                        row_scatter=bool(settings.row_scatter),
                        packed_amax=bool(settings.packed_amax))


def quantize_tile(spec):
    """(TM, TK) of the tile a quantize CTA owns."""
    ve = ELEMS_PER_CHUNK[spec.kind]
    if spec.recipe == BLOCK2D or (spec.recipe == BLOCK1D and spec.columnwise):
        return 128, 128
    if spec.recipe == BLOCK1D:
        return (64 if ve == 8 else 32), 128
    if spec.columnwise:  # MXFP8 with 32x1 blocks: the tile is one block tall
        return 32, (256 if ve == 8 else 128)
    return (64 if ve == 8 else 32), 128


@dataclass(frozen=True)
class QuantizeGroupSpec:
    """One launch of the work of 2 or 3 quantize variants, each on its own input and outputs
    (``_quantize_kernel.make_group_kernel_pyfunc``): the parts' tiles on one 1-D grid, part
    i's CTAs after part i - 1's. The parts share the CTA size; their own launch bounds are
    folded into the group's (`min_blocks`)."""

    parts: tuple            # QuantizeSpec each: one `threads`, min_blocks None
    min_blocks: Optional[int] = None


GROUP_SIZES = (2, 3)


def quantize_group_spec(specs):
    """The QuantizeGroupSpec of quantize variants `specs` (2 or 3 QuantizeSpecs). A byte of a
    quantize output depends on its block's values alone, never on the CTA size, so parts of
    different `threads` run at 256 (a size every tile takes). The group asks the register
    allocator for the most resident threads any part asks for (min_blocks x threads)."""
    specs = tuple(specs)
    if len(specs) not in GROUP_SIZES:
        raise ValueError(f"a quantize group has {GROUP_SIZES} parts, got {len(specs)}")
    sizes = {s.threads for s in specs}
    threads = sizes.pop() if len(sizes) == 1 else 256
    resident = [s.min_blocks * s.threads for s in specs if s.min_blocks is not None]
    min_blocks = max(1, max(resident) // threads) if resident else None
    return QuantizeGroupSpec(parts=tuple(replace(s, threads=threads, min_blocks=None)
                                         for s in specs), min_blocks=min_blocks)


# ---- dequantize -------------------------------------------------------------------------------
DQ_THREADS = 256        # threads per CTA of the rows and tiles kernels
DQ_TILE = 128           # tile edge (bytes) of the tiles kernel
BX, BY = 32, 8          # CTA shape of the scalar kernel
MAX_GRID_Y = 65535      # CUDA's limit; the kernels loop over grid rows beyond it

F32_OUT, BF16_OUT, F16_OUT = 0, 1, 2
OUT_SIZE = {F32_OUT: 4, BF16_OUT: 2, F16_OUT: 2}
# elements per piece: one 16-byte store of output
PIECE = {F32_OUT: 4, BF16_OUT: 8, F16_OUT: 8}
ROWS, TILES, SCALAR = "rows", "tiles", "scalar"


@dataclass(frozen=True)
class DequantizeSpec:
    """One variant of the dequantize kernels (``_dequantize_kernel``)."""

    recipe: str             # BLOCK1D | BLOCK2D | MXFP8
    columnwise: bool        # source buffers are the columnwise ones
    e4m3: bool
    out_kind: int           # F32_OUT | BF16_OUT | F16_OUT
    path: str               # ROWS | TILES | SCALAR
    piece: int = 0          # elements per piece of the vector paths: 0 = PIECE[out_kind]
    #                         (16-byte stores), or half of it for 16-bit outputs (8-byte
    #                         stores; K % 8 == 4)
    aligned: bool = True    # TILES: source rows 16-byte aligned (M % 16 == 0, aligned data)
    rows_per_thread: int = 4   # ROWS: rows each thread converts (all their loads in flight)


@dataclass(frozen=True)
class DequantizeSettings:
    """Tuning of the dequantize launcher (``dequantize.use_settings``)."""

    rows_per_thread: int = 4


def piece_of(spec):
    """Elements per piece of a vector-path dequantize spec."""
    return spec.piece or PIECE[spec.out_kind]


def transposed(spec):
    """Whether the dequantize source data is (K, M) (Block1D / Block2D columnwise)."""
    return spec.columnwise and spec.recipe != MXFP8


def dequantize_launch_bounds(spec):
    return BX * BY if spec.path == SCALAR else DQ_THREADS


# ---- transpose --------------------------------------------------------------------------------
TR_THREADS = 256
TR_TILE = 128  # tile edge (bytes)


@dataclass(frozen=True)
class TransposeSpec:
    """One variant of the Block2D transpose kernel (``_transpose_kernel``)."""

    vec_in: bool    # C % 16 == 0 and aligned source (16-byte loads)
    vec_out: bool   # R % 16 == 0 and aligned destination (16-byte stores)


# ---- RMSNorm ----------------------------------------------------------------------------------
RMS_THREADS = 256       # threads per CTA
RMS_MAX_CHUNKS = 8      # 16-byte chunks of a row per thread, at most (registers)
RMS_ROW_ITERS = 16      # rows per row group per CTA (the backward's dw partials: one per group)


@dataclass(frozen=True)
class RMSNormSpec:
    """One variant of the RMSNorm kernels (``_rms_norm_kernel``): a row of D elements is
    read as D / ELEMS_PER_CHUNK[kind] 16-byte chunks by a group of `row_threads` threads (a
    power of two), `chunks` per thread (lane l: chunks l, l + row_threads, ...)."""

    kind: int               # F32 | BF16 | F16: x, the weight, y (dy, dx) alike
    backward: bool
    chunks: int             # chunks per thread
    row_threads: int        # threads per row (power of two, <= threads)
    threads: int = RMS_THREADS


def rms_norm_spec(kind, width, backward):
    """The RMSNormSpec for rows of `width` elements (a multiple of ELEMS_PER_CHUNK[kind]),
    or None when a row is too wide for RMS_MAX_CHUNKS chunks per thread."""
    nch = width // ELEMS_PER_CHUNK[kind]
    row_threads = 1
    while row_threads < nch and row_threads < RMS_THREADS:
        row_threads *= 2
    chunks = -(-nch // row_threads)
    if chunks > RMS_MAX_CHUNKS:
        return None
    return RMSNormSpec(kind=int(kind), backward=bool(backward), chunks=chunks,
                       row_threads=row_threads)


# ---- SiLU gate -----------------------------------------------------------------------------
SILU_THREADS = 256      # threads per CTA
SILU_ITERS = 4          # 16-byte chunks per thread (CTA-strided: a warp's loads coalesce)


@dataclass(frozen=True)
class SiluGateSpec:
    """One variant of the SiLU-gate kernels (``_silu_gate_kernel``): ``silu(g) * u`` forward,
    or its two input gradients, on 2-byte float rows (BF16 | F16: every operand alike)."""

    kind: int
    backward: bool


# ---- weighted rows (the experts' combine, backward) --------------------------------------------
ROWS_THREADS = 256      # threads per CTA
ROWS_ITERS = 4          # 16-byte chunks per thread (CTA-strided)


@dataclass(frozen=True)
class WeightedRowsSpec:
    """One variant of the weighted-rows kernel (``_weighted_rows_kernel``): token rows of a
    2-byte float kind (BF16 | F16), scaled by fp32 weights into the padded rows, same kind."""

    kind: int


# ---- master-weight kernels: batch table fields and specs ---------------------------------------
F_H, F_W, F_O, F_N = 0, 1, 2, 3
F_MOFF = 4      # master offset from the base, in elements of the master's dtype
F_MBF16 = 5     # 1: the master is bf16 (else fp32)
F_MVEC = 6      # 1: master offset aligned for vector loads (fp32: 16 B, bf16: 4 B)
F_VEC2D = 7     # 1: F_MVEC and o % 4 == 0 and w % 4 == 0 (every row segment aligned)
F_E4M3 = 8      # 1: E4M3, 0: E5M2
F_POW2 = 9
F_EPS = 10      # float32 bits of amax_epsilon
F_ROWBUF = 11   # offset of the weight's rowwise (Block2D: tile) entries in the packed buffer
F_COLBUF = 12   # offset of its MXFP8 columnwise entries (multiple of 4), or -1
F_ROWDATA = 13  # byte offset of the rowwise destination of flat index f is F_ROWDATA + f
F_COLDATA = 14  # same for MXFP8 columnwise data; Block2D transposed data starts here
F_ROWSINV = 15  # offset of rowwise scale_inv (fp32 elements / bytes), -1 if not held
F_COLSINV = 16
F_HASROW = 17
F_HASCOL = 18
F_AMAX0 = 19    # first CUDA block of this weight in its partial-amax launch
F_BAND0 = 20    # first tile row (Block2D) / 32-row band (MXFP8) the shard touches
F_NCB = 21      # CUDA blocks per band: cdiv(w, 128) (Block2D), cdiv(w, 512) (MXFP8)
F_CAST0 = 22    # first CUDA block in its cast launch
F_SCALE0 = 23   # first entry in the scale launch
F_AMAXF0 = 24   # first CUDA block of this weight in its fast-path partial-amax launch
F_FASTROW0 = 25  # band rows [F_FASTROW0, F_FASTROW1) lie inside the shard (fast path); the
F_FASTROW1 = 26  # touched rows before and after them take the general path
F_CASTF0 = 27   # first CUDA block in its fast-path cast launch
F_NFC = 28      # chunks 0 .. F_NFC-1 of the shard take the fast-path cast, the rest the general
NF = 29

AMAX2D_THREADS = 256
MXAMAX_THREADS = 128
MX_COLS = 512          # columns per MXFP8 amax block
CAST_THREADS = 256
CAST_GROUPS = 4        # groups of 4 elements per thread
CAST_CHUNK = CAST_THREADS * CAST_GROUPS * 4
SCALE_THREADS = 256


@dataclass(frozen=True)
class PartialAmaxSpec:
    """One partial-amax kernel (``_partial_amax_kernel``)."""

    block2d: bool           # Block2D tiles, else MXFP8 blocks
    model: int              # F32 | BF16 | F16: the model dtype values are rounded to
    with_col: bool          # MXFP8: also the columnwise (32x1) codes
    fast_path: bool         # interior bands of aligned shards (no bounds checks)
    min_blocks: Optional[int] = None   # min CTAs per SM for the register allocator


@dataclass(frozen=True)
class PartialScaleSpec:
    """One scale kernel of the master-weight path (``_partial_cast_kernel``)."""

    block2d: bool
    vinf: float             # Block2D: the scale when F / amax overflows (model dtype max)


@dataclass(frozen=True)
class PartialCastSpec:
    """One partial-cast kernel (``_partial_cast_kernel``)."""

    block2d: bool
    model: int
    with_col: bool
    fast_path: bool
    min_blocks: Optional[int] = None


@dataclass(frozen=True)
class MasterSettings:
    """Tuning of the master-weight launchers (``partial.use_settings``): minimum CTAs
    per SM of the fast-path kernels (None: the compiler's choice). MXFP8 amax: 4 CTAs of 128
    threads (<= 128 registers, no spills) measured faster than the compiler's choice
    (``python -m bench.bench_master --sweep``)."""

    amax_fast_min_blocks_block2d: Optional[int] = None
    amax_fast_min_blocks_mxfp8: Optional[int] = 4
    cast_fast_min_blocks_block2d: Optional[int] = None
    cast_fast_min_blocks_mxfp8: Optional[int] = None


def partial_amax_spec(block2d, model, with_col, fast_path, settings=MasterSettings()):
    mb = None
    if fast_path:
        mb = settings.amax_fast_min_blocks_block2d if block2d else \
            settings.amax_fast_min_blocks_mxfp8
    return PartialAmaxSpec(bool(block2d), int(model), bool(with_col), bool(fast_path), mb)


def partial_cast_spec(block2d, model, with_col, fast_path, settings=MasterSettings()):
    mb = None
    if fast_path:
        mb = settings.cast_fast_min_blocks_block2d if block2d else \
            settings.cast_fast_min_blocks_mxfp8
    return PartialCastSpec(bool(block2d), int(model), bool(with_col), bool(fast_path), mb)
