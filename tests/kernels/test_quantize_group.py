"""The quantize group's spec and launch geometry on the CPU (fp8blk/kernels/_specs.py,
quantize.py): the parts agree on one CTA size, the group keeps the register cap its parts ask
for, every part's field is in the cache key, and the arguments come part after part. The
group's bytes: the simulator job (sim_cases.GROUP_CASES) and the GPU tests."""
import dataclasses

import pytest

from fp8blk.kernels import _cache
from fp8blk.kernels import _specs as sp


def _spec(recipe, kind, rw, cw, settings=sp.QuantizeSettings()):
    return sp.quantize_spec(recipe, kind, True, rw, cw, True, 0.0, 3.0e38, True, True, settings)


def test_group_parts_share_one_cta_size_and_the_strictest_register_cap():
    dy, wt = _spec(sp.BLOCK1D, sp.BF16, True, True), _spec(sp.BLOCK2D, sp.BF16, False, True)
    g = sp.quantize_group_spec([dy, wt])
    assert [p.threads for p in g.parts] == [256, 256] and g.min_blocks == 3
    assert all(p.min_blocks is None for p in g.parts)
    assert g.parts[0] == dataclasses.replace(dy, min_blocks=None)
    # a 512-thread part (2 CTAs of 512 per SM asked) runs at 256, 4 CTAs of 256 asked
    wide = sp.QuantizeSettings(fused_block1d_threads=512)
    g = sp.quantize_group_spec([_spec(sp.BLOCK1D, sp.BF16, True, True, wide), wt])
    assert [p.threads for p in g.parts] == [256, 256] and g.min_blocks == 4
    # parts that agree keep their size; no cap asked, none given
    both = sp.QuantizeSettings(fused_block1d_threads=512, block2d_row_threads=512)
    g = sp.quantize_group_spec([_spec(sp.BLOCK1D, sp.BF16, True, True, both),
                                _spec(sp.BLOCK2D, sp.BF16, True, False, both)])
    assert [p.threads for p in g.parts] == [512, 512] and g.min_blocks == 2
    g = sp.quantize_group_spec([_spec(sp.BLOCK1D, sp.F32, True, False),
                                _spec(sp.BLOCK2D, sp.F32, True, False)])
    assert g.min_blocks is None
    for n in (1, 4):
        with pytest.raises(ValueError):
            sp.quantize_group_spec([dy] * n)


def test_every_part_field_changes_the_group_key():
    dy, wt = _spec(sp.BLOCK1D, sp.BF16, True, True), _spec(sp.BLOCK2D, sp.BF16, False, True)
    g = sp.quantize_group_spec([dy, wt])
    seen = {_cache.key("quantize_group", g, (9, 0))[0]}
    for i in range(2):
        for f in ("kind", "e4m3", "rowwise", "columnwise", "pow2", "eps", "vec", "col_vec",
                  "row_scatter", "packed_amax", "recipe"):
            part = g.parts[i]
            v = getattr(part, f)
            other = {bool: lambda: not v, int: lambda: 1 - v if v in (0, 1) else v + 1,
                     float: lambda: v + 1.0, str: lambda: sp.MXFP8}[type(v)]()
            parts = list(g.parts)
            parts[i] = dataclasses.replace(part, **{f: other})
            d = _cache.key("quantize_group", dataclasses.replace(g, parts=tuple(parts)),
                           (9, 0))[0]
            assert d not in seen, (i, f)
            seen.add(d)


def test_group_arguments_come_part_after_part():
    from fp8blk.kernels import _quantize_kernel as qk

    parts = [_spec(sp.BLOCK1D, sp.F32, True, False), _spec(sp.BLOCK2D, sp.BF16, False, True),
             _spec(sp.BLOCK1D, sp.BF16, False, True)]
    g = sp.quantize_group_spec(parts)
    got = qk.group_argtypes(g)
    each = [qk.argtypes(p) for p in g.parts]
    assert got == each[0][:5] + each[1][:5] + each[2][:5] + each[0][5:] + each[1][5:] \
        + each[2][5:]
    assert len(got) == 21
