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
]
DEQUANT_CASES = [  # (recipe, columnwise, out dtype, shape)
    ("b1d", False, "f32", (20, 136)),
    ("b1d", True, "bf16", (130, 40)),
    ("b2d-e5m2-nopow2", False, "f16", (20, 136)),
    ("b2d", True, "f32", (130, 130)),
    ("mx", False, "bf16", (32, 96)),
    ("mx-e5m2", True, "f16", (64, 64)),
]
TRANSPOSE_CASES = [(130, 136), (129, 141), (256, 128)]


def names():
    """Case names, as sim_runner reports them."""
    return ([f"quantize-{r}-{d}-r{int(rw)}c{int(cw)}-{s[0]}x{s[1]}"
             for r, d, rw, cw, s in QUANTIZE_CASES]
            + [f"dequantize-{r}-c{int(cw)}-{o}-{s[0]}x{s[1]}" for r, cw, o, s in DEQUANT_CASES]
            + [f"transpose-{s[0]}x{s[1]}" for s in TRANSPOSE_CASES])
