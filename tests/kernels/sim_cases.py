"""Case lists of the simulator tests (no imports: test_sim.py reads them without numba)."""

# (recipe, dtype, rowwise, columnwise, shape): at most 2 CTAs each (the simulator's cost grows
# with threads x barriers), edge blocks in both dims
QUANTIZE_CASES = [
    ("b1d", "bf16", True, False, (37, 200)),
    ("b1d", "f32", True, False, (9, 131)),          # unaligned K: scalar path
    ("b1d-e5m2-nopow2", "f16", True, False, (20, 136)),
    ("b1d", "bf16", False, True, (112, 136)),     # M % 16 == 0: 16-byte stores
    ("b1d-eps", "f32", False, True, (99, 133)),     # scalar loads, unaligned (K, M) rows
    ("b1d", "f16", True, True, (100, 144)),
    ("b1d-e5m2-nopow2", "bf16", True, True, (77, 141)),
    ("b2d", "bf16", True, False, (100, 136)),
    ("b2d", "f32", True, True, (70, 140)),
    ("b2d-e5m2-nopow2", "f16", False, True, (99, 141)),
    ("b2d", "bf16", True, True, (112, 160)),
    ("mx", "bf16", True, False, (64, 96)),
    ("mx-e5m2", "f32", True, True, (64, 96)),
    ("mx", "f16", False, True, (32, 288)),
    ("mx", "bf16", True, True, (64, 256)),
    # transposed (K, M) outputs with M % 16 != 0 (_kernel_lib.tile_row_storer): an odd M starts
    # rows at every address % 16; tile rows of 128 bytes, of 16..127, and narrower than 16
    ("b1d", "bf16", False, True, (201, 128)),      # 16-byte loads; tiles of 128 + 73 bytes
    ("b2d", "bf16", True, True, (142, 96)),        # 128 + 14 bytes; rows k >= K skipped
    ("b1d-e5m2-nopow2", "f16", False, True, (148, 64)),  # M % 16 == 4: rows start on words
]
# Group launches (fp8blk.kernels.quantize.quantize_group): parts of (recipe, dtype, rowwise,
# columnwise, shape), one launch, each part's bytes against the reference (the single kernel's
# bytes, the cases above). A Linear's forward pair (x 1x128 rowwise + columnwise, W 128x128
# rowwise; one CTA each), and its backward with a keep_input layer's x (dY 1x128 both ways and
# W 128x128 both ways, two CTAs each: tiles mapped off a part's first CTA, the later parts'
# CTAs offset; x 1x128 rowwise in fp32, one CTA); edge blocks and scale padding in each
GROUP_CASES = [
    (("b1d", "bf16", True, True, (37, 40)), ("b2d", "bf16", True, False, (40, 40))),
    (("b1d", "bf16", True, True, (37, 141)), ("b2d-e5m2-nopow2", "bf16", True, True, (141, 37)),
     ("b1d-eps", "f32", True, False, (9, 100))),
]
# (recipe, columnwise, out dtype, shape). Paths (fp8blk.kernels.dequantize): "rows" for (M, K)
# sources with K % E == 0 (E = 4 fp32 / 8 bf16, fp16 elements per lane; 16-bit outputs also
# K % 8 == 4 with 4-element pieces), CTA = 32 rows x 32 lanes (fewer lanes per row, more rows
# for narrow K); "tiles" for transposed (K, M) sources with K % E == 0 (likewise), CTA =
# 128 x 128, 16-byte loads when M % 16 == 0, else shifted pairs of aligned chunks (tiles
# touching the buffer's last chunks load byte by byte); "scalar" otherwise. The runner plants
# all 256 FP8 codes and E8M0 codes 0/1/254/255 (_cases.plant_fp8_specials).
DEQUANT_CASES = [
    ("b1d", False, "bf16", (37, 136)),              # rows: 2 row groups, edge k-block
    ("b1d-e5m2-nopow2", False, "f32", (20, 132)),   # rows: 2 CTAs along K (128 + 4)
    ("b2d-e5m2-nopow2", False, "f16", (136, 40)),   # rows: 8 lanes per row, edge M tile
    ("mx", False, "bf16", (32, 96)),                # rows: 16 lanes per row
    ("mx-e5m2", True, "f16", (64, 64)),             # rows: per-element E8M0 codes
    ("mx", True, "f32", (64, 96)),                  # rows: 4 codes per lane, 2 row groups
    ("b1d", False, "bf16", (9, 132)),               # rows, 4-element pieces: K % 8 == 4
    ("b2d", False, "f16", (40, 260)),               # rows, 4-element pieces, 3 k-blocks
    ("b1d", True, "bf16", (144, 112)),              # tiles: 128 + 16 rows m, K < 128
    ("b2d-e5m2-nopow2", True, "f32", (112, 200)),   # tiles: 2 k-tiles (128 + 72)
    ("b1d-eps", True, "f16", (48, 136)),            # tiles: 2 k-tiles (128 + 8)
    ("b1d", True, "bf16", (48, 140)),               # tiles, 4-element pieces, aligned rows
    # tiles with rows at any alignment: M % 16 in {1, 3, 8, 15}; first tile interior
    # (shifted chunk pairs), second one at the buffer's end (edge loads)
    ("b1d", True, "bf16", (99, 200)),               # M % 16 == 3, 2 k-tiles
    ("b2d", True, "f32", (145, 96)),                # M % 16 == 1, 2 m-tiles (128 + 17)
    ("b2d-e5m2-nopow2", True, "bf16", (120, 136)),  # M % 16 == 8, 2 k-tiles (128 + 8)
    ("b1d-e5m2-nopow2", True, "f16", (47, 256)),    # M % 16 == 15, 2 full k-tiles
    ("b1d", True, "f16", (130, 20)),                # M % 16 == 2, 4-element pieces, edge only
    # K * M <= 256: all bytes planted (quantize's last data row is zero), so the byte-wise
    # loads of rows whose chunks would reach past the buffer's end see real codes
    ("b1d", True, "bf16", (13, 12)),                # 13 bytes of row 11 byte by byte
    ("b2d-e5m2-nopow2", True, "f32", (11, 20)),     # 11 bytes of row 19 byte by byte
    ("b1d", False, "bf16", (9, 131)),               # scalar: K odd
    ("b2d", True, "f32", (40, 130)),                # scalar: fp32 with K % 4 != 0, transposed
]
# (R, C); (K, M) = (C, R) outputs: 16-byte loads with R odd (128 + 73-byte tile rows), and
# R % 16 == 2 (128 + 18 bytes)
TRANSPOSE_CASES = [(130, 136), (129, 141), (256, 128), (201, 128), (146, 48)]
# RMSNorm (M, D, dtype), forward then backward (the runner plants a row with an inf and a
# row of zeros): a CTA-wide row group whose lane 0 holds 2 chunks (2056 = 257 chunks), 2
# forward CTAs; 16 threads per row, 2 forward CTAs; float32 and float16 (each CTA of the
# simulator costs seconds: the GPU tests cover many CTAs)
RMS_NORM_CASES = [(5, 2056, "bf16"), (70, 128, "bf16"), (9, 24, "f32"), (6, 40, "f16")]

# SiLU gate (M, I, dtype), forward then backward against the NumPy formula (the runner plants
# infinities, NaN, signed zeros and exp's overflow range in g): one CTA; two CTAs of fp16
SILU_GATE_CASES = [(5, 24, "bf16"), (130, 64, "f16")]
# weighted rows (T, k, H, R, dtype): padding rows between and after the routed ones, a zero
# and a negative weight, a row with +-0, inf and NaN; one CTA, and three
WEIGHTED_ROWS_CASES = [(7, 3, 24, 40, "bf16"), (130, 8, 16, 1100, "bf16")]


def names():
    """Case names, as sim_runner reports them."""
    return ([f"quantize-{r}-{d}-r{int(rw)}c{int(cw)}-{s[0]}x{s[1]}"
             for r, d, rw, cw, s in QUANTIZE_CASES]
            + [group_name(parts) for parts in GROUP_CASES]
            + [f"dequantize-{r}-c{int(cw)}-{o}-{s[0]}x{s[1]}" for r, cw, o, s in DEQUANT_CASES]
            + [f"transpose-{s[0]}x{s[1]}" for s in TRANSPOSE_CASES]
            + [f"rms_norm-{d}-{m}x{k}" for m, k, d in RMS_NORM_CASES]
            + [f"silu_gate-{d}-{m}x{i}" for m, i, d in SILU_GATE_CASES]
            + [f"weighted_rows-{d}-{t}x{k}x{h}-{r}" for t, k, h, r, d in WEIGHTED_ROWS_CASES])


def group_name(parts):
    return "quantize_group-" + "+".join(f"{r}-{d}-r{int(rw)}c{int(cw)}-{sh[0]}x{sh[1]}"
                                        for r, d, rw, cw, sh in parts)
