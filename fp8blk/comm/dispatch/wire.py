"""The quantized all-to-all's wire (docs/distributed.md, "Quantized all-to-all"): what travels
for each row, and the turns between fp8blk's rowwise Block1D scale layout, (cdiv(K,128),
round4(M)) fp32, and the token-major scales on the wire, (rows, cdiv(K,128)).

Each row's FP8 bytes travel as they are (the quantized (M, K) data is already row-major, peer
by peer: it is sent and received in place). Its scales travel token-major as a second part
with the same row counts, so a row's scales go wherever the row goes and the receiver's only
reshuffle is the scales' transpose (1/128 of the data, or 1/32 with fp32 scales).

Power-of-two scales (``pow2_scales=True``, the default recipe) travel as ONE byte each: a
scale_inv is 2^e with e in [-127, 121] (the scale is F / amax rounded down to a power of two,
at most 2^127 for the smallest amaxes, at least F / FLT_MAX), and the byte is the fp32
exponent field of scale_inv, which is e + 127, E8M0's code for 2^e; 2^-127 is the one fp32
subnormal among them (exponent field 0, mantissa 0x400000) and gets code 0. The decode is a
shift back into the exponent field: exact both ways. Other recipes send the fp32 scales.
"""
from __future__ import annotations

import numpy as np

from ...layout import all_layouts, cdiv

_SUBNORMAL_2_POW_M127 = 0x00400000  # fp32 bits of 2^-127


def scale_blocks(k: int) -> int:
    """1x128 blocks per row of K elements."""
    return cdiv(k, 128)


def wire_scale_bytes(recipe) -> int:
    """Bytes per scale on the wire: 1 for power-of-two scales, else 4 (fp32)."""
    return 1 if recipe.pow2_scales else 4


def encode_scales(xp, scale_inv, rows, recipe):
    """Token-major wire scales (rows, blocks * wire_scale_bytes) uint8 of the first ``rows``
    columns of a rowwise Block1D ``scale_inv`` (blocks, round4(rows)) fp32."""
    token_major = xp.ascontiguousarray(scale_inv[:, :rows].T)
    if not recipe.pow2_scales:
        return token_major.view(np.uint8).reshape(rows, 4 * scale_inv.shape[0])
    # the exponent field; sign 0 and exponents <= 248 make it fit a byte exactly
    return (token_major.view(np.uint32) >> 23).astype(np.uint8)


def decode_scales(xp, wire, rows, blocks, recipe, scale_inv):
    """Write the rowwise Block1D ``scale_inv`` (blocks, round4(rows)) fp32 of ``rows`` received
    rows from their token-major wire scales, the padding columns as fp8blk.layout fills them.
    The one-byte codes decode as ``fp8blk.scaling.e8m0_decode`` does (that one is NumPy's;
    this runs in the arrays' own family, `xp`)."""
    if recipe.pow2_scales:
        codes = wire.astype(np.uint32)
        bits = xp.where(codes == 0, np.uint32(_SUBNORMAL_2_POW_M127), codes << 23)
        values = bits.astype(np.uint32).view(np.float32)
    else:
        values = wire.view(np.float32).reshape(rows, blocks)
    scale_inv[:, :rows] = values.T
    scale_inv[:, rows:] = all_layouts(recipe, rows, blocks * 128)[1].fill


__all__ = ["scale_blocks", "wire_scale_bytes", "encode_scales", "decode_scales"]
