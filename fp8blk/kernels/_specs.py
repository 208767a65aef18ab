"""Numba-free definitions shared by the launchers and the kernel builders: input, output and
recipe kinds, and each kernel family's spec with the launch geometry derived from it.

A spec names one compiled kernel variant. Launchers build specs and plans from it without
importing numba (a cached kernel loads without compiling); builders (``_*_kernel.py``)
generate the kernel from the spec alone.
"""
from __future__ import annotations

from collections import namedtuple

# ---- input kinds (quantize inputs, master-weight model dtypes) --------------------------------
F32, BF16, F16 = 0, 1, 2
ELEMS_PER_CHUNK = {F32: 4, BF16: 8, F16: 8}   # elements per 16-byte chunk
ITEMSIZE = {F32: 4, BF16: 2, F16: 2}
NAN_WORD = {F32: 0x7FC00000, BF16: 0x7FC07FC0, F16: 0x7E007E00}
NAN_HALF = {BF16: 0x7FC0, F16: 0x7E00}

# ---- recipe kinds -----------------------------------------------------------------------------
BLOCK1D, BLOCK2D, MXFP8 = "block1d", "block2d", "mxfp8"


# ---- quantize ---------------------------------------------------------------------------------
THREADS = 256          # threads per CTA unless quantize_threads(spec) says otherwise
# Threads per CTA of the fused Block1D row+col kernel on 2-byte inputs (benchmark knob, read at
# kernel build time). 512 halves the tile each thread holds and avoids spills at 64 registers,
# but the H200 sweep (bench/NOTES.md, bench/sweep_fused.py) measured 256 threads with 3 CTAs
# per SM (80 registers, 40 B spilled outside the hot loop) faster: 84.5% of copy against 79.3%.
FUSED_BLOCK1D_THREADS = 256
# Threads per CTA of the Block2D rowwise-only kernel on 2-byte inputs (benchmark knob, read at
# kernel build time; 512 halves the tile share each thread holds).
BLOCK2D_ROW_THREADS = 256

QuantSpec = namedtuple("QuantSpec", [
    "recipe",       # BLOCK1D | BLOCK2D | MXFP8
    "kind",         # F32 | BF16 | F16
    "e4m3",         # bool
    "rowwise",      # bool
    "columnwise",   # bool
    "pow2",         # bool (fp32-scale recipes)
    "eps",          # float (fp32-scale recipes)
    "vmax",         # float: the input dtype's max (scale when F/amax overflows)
    "vec",          # bool: K % VE == 0 (16-byte loads, 8/4-byte stores along K)
    "col_vec",      # bool: M % 16 == 0 (16-byte stores of transposed bytes along M)
])


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


def quantize_threads(spec):
    """Threads per CTA of the quantize kernel for `spec`."""
    if spec.recipe == BLOCK1D and spec.rowwise and spec.columnwise and spec.kind != F32:
        return FUSED_BLOCK1D_THREADS
    if spec.recipe == BLOCK2D and not spec.columnwise and spec.kind != F32:
        return BLOCK2D_ROW_THREADS
    return THREADS


def quantize_grid(spec, rows, cols):
    tm, tk = quantize_tile(spec)
    return (-(-rows // tm), -(-cols // tk), 1)


# ---- dequantize -------------------------------------------------------------------------------
DQ_THREADS = 256        # threads per CTA of the rows and tiles kernels
# Rows each thread of the rows kernel converts (loads of all of them in flight at once;
# benchmark knob, read at kernel build time).
ROWS_PER_THREAD = 4
DQ_TILE = 128           # tile edge (bytes) of the tiles kernel
BX, BY = 32, 8          # CTA shape of the scalar kernel
MAX_GRID_Y = 65535      # CUDA's limit; the kernels loop over grid rows beyond it

F32_OUT, BF16_OUT, F16_OUT = 0, 1, 2
OUT_SIZE = {F32_OUT: 4, BF16_OUT: 2, F16_OUT: 2}
# elements per piece: one 16-byte store of output
PIECE = {F32_OUT: 4, BF16_OUT: 8, F16_OUT: 8}
ROWS, TILES, SCALAR = "rows", "tiles", "scalar"

DequantSpec = namedtuple("DequantSpec", [
    "recipe",       # BLOCK1D | BLOCK2D | MXFP8
    "columnwise",   # bool: source buffers are the columnwise ones
    "e4m3",         # bool
    "out_kind",     # F32_OUT | BF16_OUT | F16_OUT
    "path",         # ROWS | TILES | SCALAR
    "piece",        # elements per piece of the vector paths: 0 = PIECE[out_kind] (16-byte
                    # stores), or half of it for 16-bit outputs (8-byte stores; K % 8 == 4)
    "aligned",      # TILES: source rows 16-byte aligned (M % 16 == 0, aligned data)
], defaults=(0, True))


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
