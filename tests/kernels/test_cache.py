"""fp8blk's compiled-kernel disk cache (fp8blk/kernels/_cache.py) on the CPU: keys
hold every setting, writes are atomic, concurrent processes build a key once, sources and the
switch invalidate / disable it, and the hit path imports no numba. Builds are fake functions
(no GPU); test_backend.py compiles real variants."""
import ast
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from fp8blk.kernels import _cache
from fp8blk.kernels import _specs as sp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KERNELS = os.path.join(_REPO, "fp8blk", "kernels")

# one instance of every spec type, each field off its default where it has one
SPECS = {
    "quantize": sp.quantize_spec(sp.BLOCK1D, sp.BF16, True, True, True, True, 0.0,
                                 3.3895313892515355e38, True, True),
    "quantize_group": sp.quantize_group_spec([
        sp.quantize_spec(sp.BLOCK1D, sp.BF16, True, True, True, True, 0.0, 3.0e38, True, True),
        sp.quantize_spec(sp.BLOCK2D, sp.F32, True, False, False, True, 0.0, 3.0e38, True,
                         False)]),
    "dequantize": sp.DequantizeSpec(sp.BLOCK2D, True, False, sp.BF16_OUT, sp.TILES, 4, False),
    "transpose": sp.TransposeSpec(True, False),
    "partial_amax": sp.partial_amax_spec(False, sp.BF16, True, True),
    "partial_scale": sp.PartialScaleSpec(True, 65504.0),
    "partial_cast": sp.partial_cast_spec(True, sp.F16, False, True),
    "rms_norm": sp.rms_norm_spec(sp.BF16, 4096, True),
    "silu_gate": sp.SiluGateSpec(sp.F16, True),
    "weighted_rows": sp.WeightedRowsSpec(sp.F16),
}


def _other(value):
    """A value of the same kind that differs from `value`."""
    if isinstance(value, bool):
        return not value
    if value is None:
        return 2
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):    # a group's parts, in another order
        return value[::-1]
    raise TypeError(value)


def test_family_table_covers_every_spec_type():
    assert set(SPECS) == set(_cache.FAMILIES)
    spec_types = {cls for cls in vars(sp).values()
                  if dataclasses.is_dataclass(cls) and cls.__name__.endswith("Spec")}
    assert {type(s) for s in SPECS.values()} == spec_types


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_spec_field_changes_the_key(family):
    """Two specs that differ in any one field never share an entry; the key also changes with
    the compute capability, and is the same for equal specs."""
    spec = SPECS[family]
    assert dataclasses.is_dataclass(spec) and type(spec).__dataclass_params__.frozen
    digest, desc = _cache.key(family, spec, (9, 0))
    assert _cache.key(family, dataclasses.replace(spec), (9, 0))[0] == digest
    assert _cache.key(family, spec, (10, 0))[0] != digest
    seen = {digest}
    for f in dataclasses.fields(spec):
        other = dataclasses.replace(spec, **{f.name: _other(getattr(spec, f.name))})
        d, _ = _cache.key(family, other, (9, 0))
        assert d not in seen, f"{family}: field {f.name} does not change the key"
        seen.add(d)
    assert set(desc["spec"]) == {f.name for f in dataclasses.fields(spec)}
    assert desc["toolchain"]["numba"] and desc["toolchain"]["python"]


def test_toolchain_versions_match_package_metadata():
    """The key's toolchain versions (read from the metadata folders' names, the fast way) are
    what importlib.metadata reports."""
    from importlib import metadata

    want = {}
    for name in _cache.TOOLCHAIN:
        try:
            want[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    got = _cache._installed_versions(_cache.TOOLCHAIN)
    assert got == want and "numba" in got and "numba-cuda" in got


def test_key_is_exact_for_floats_and_kinds():
    """0 and 0.0, 0.0 and -0.0, and neighbouring floats are different keys; ints and bools
    never collide."""
    s = SPECS["partial_scale"]
    keys = {_cache.key("partial_scale", dataclasses.replace(s, vinf=v), (9, 0))[0]
            for v in (0.0, -0.0, 1.0, 1.0000000000000002)}
    assert len(keys) == 4
    with pytest.raises(TypeError):
        _cache.spec_fields(dataclasses.replace(s, vinf=[1.0]))


def test_settings_are_spec_fields_and_builders_read_no_tunables():
    """Every former build-time knob (module attributes the builders read, benchmarks
    monkeypatched) is gone; the settings objects are frozen and resolve into spec fields."""
    knobs = {"FUSED_BLOCK1D_THREADS", "BLOCK2D_ROW_THREADS", "ROW_SCATTER", "PACKED_AMAX",
             "MIN_BLOCKS_PER_SM", "ROWS_PER_THREAD", "FAST_MIN_BLOCKS"}
    for name in os.listdir(_KERNELS):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(_KERNELS, name)).read())
            top = {t.id for node in tree.body if isinstance(node, ast.Assign)
                   for t in node.targets if isinstance(t, ast.Name)}
            assert not top & knobs, f"{name} defines {top & knobs}"
            if name.startswith("_") and name.endswith("_kernel.py"):
                # builders: no module-level mutable state a caller could change
                for node in tree.body:
                    if isinstance(node, ast.Assign):
                        assert not isinstance(node.value, (ast.Dict, ast.List, ast.Set)), \
                            f"{name}: module-level container {ast.dump(node.targets[0])}"
    for settings in (sp.QuantizeSettings(), sp.DequantizeSettings(), sp.MasterSettings()):
        assert type(settings).__dataclass_params__.frozen
    q = sp.QuantizeSettings(fused_block1d_threads=512, row_scatter=False, packed_amax=False,
                            min_blocks_per_sm=2)
    spec = sp.quantize_spec(sp.BLOCK1D, sp.BF16, True, True, True, True, 0.0, 1.0, True, True, q)
    assert (spec.threads, spec.min_blocks, spec.row_scatter, spec.packed_amax) == \
        (512, 2, False, False)
    default = sp.quantize_spec(sp.BLOCK1D, sp.BF16, True, True, True, True, 0.0, 1.0, True,
                               True)
    assert (default.threads, default.min_blocks) == (256, 3)  # the H200 sweep's choice


def test_dequantize_rows_per_thread_is_in_the_key_and_the_plan():
    """The old lru_cache keyed dequantize kernels by spec while the kernel read a module-level
    ROWS_PER_THREAD: changing it reused stale kernels. Now it is a spec field, set from the
    launcher's settings, and the launch grid uses the same value."""
    import numpy as np

    from fp8blk import Block1D
    from fp8blk.kernels import dequantize as dq
    spec4 = sp.DequantizeSpec(sp.BLOCK1D, False, True, sp.BF16_OUT, sp.ROWS)
    spec2 = dataclasses.replace(spec4, rows_per_thread=2)
    assert _cache.key("dequantize", spec4, (9, 0))[0] != \
        _cache.key("dequantize", spec2, (9, 0))[0]
    built = []
    real = _cache.kernel
    _cache.kernel = lambda family, spec, device=None: built.append(spec) or (lambda *a: None)
    try:
        grids = {}
        for rpt in (4, 2):
            previous = dq.use_settings(sp.DequantizeSettings(rows_per_thread=rpt))
            data = np.zeros((4096, 256), np.uint8)
            sinv = np.zeros((2, 4096), np.float32)
            grids[rpt] = dq.plan_for(Block1D(), False, sp.BF16_OUT, 4096, 256, data, sinv).grid
            dq.use_settings(previous)
    finally:
        _cache.kernel = real
    assert [s.rows_per_thread for s in built] == [4, 2]
    assert grids[2][1] == 2 * grids[4][1]   # twice the CTAs along M for half the rows each


def test_builders_list_every_kernel_module_they_use():
    """The key hashes the sources listed per family: each must include every fp8blk.kernels
    module its builder imports, directly or through those modules."""
    def imports(mod):
        tree = ast.parse(open(os.path.join(_KERNELS, mod + ".py")).read())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    out.add(node.module)
                else:
                    out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level > 1:
                raise AssertionError(f"{mod} imports from outside fp8blk.kernels: "
                                     f"{'.' * node.level}{node.module}")
        return out

    for family, (builder, _, sources) in _cache.FAMILIES.items():
        need, todo = set(), [builder]
        while todo:
            m = todo.pop()
            if m in need:
                continue
            need.add(m)
            todo += list(imports(m))
        assert need <= set(sources), f"{family}: sources lack {need - set(sources)}"


def test_source_change_invalidates(tmp_path):
    """A changed source gives another key; the same bytes elsewhere give the same key."""
    src = os.path.join(_KERNELS, "_transpose_kernel.py")
    a, b, c = (tmp_path / d for d in "abc")
    for d in (a, b, c):
        d.mkdir()
    text = open(src, "rb").read()
    (a / "_transpose_kernel.py").write_bytes(text)
    (b / "_transpose_kernel.py").write_bytes(text)
    (c / "_transpose_kernel.py").write_bytes(text.replace(b"THREADS", b"THREADS ", 1))
    spec = SPECS["transpose"]
    ka, kb, kc = (_cache.variant_key("transpose", spec, (9, 0), [str(d / "_transpose_kernel.py")])[0]
                  for d in (a, b, c))
    assert ka == kb != kc


def _fake_build(digest):
    def build():
        time.sleep(0.3)     # long enough that the other processes arrive while it builds
        return "fake_entry", b"\x7fELF" + digest.encode() + os.urandom(16)
    return build


def test_store_round_trip_and_atomic_write(tmp_path, monkeypatch):
    store = _cache.Store(str(tmp_path))
    digest, desc = _cache.key("transpose", SPECS["transpose"], (9, 0))
    e = store.get_or_build("transpose", digest, desc, _fake_build(digest))
    assert store.builds == 1 and e.entry == "fake_entry" and e.meta["key"] == desc
    again = _cache.Store(str(tmp_path)).get_or_build("transpose", digest, desc,
                                                     lambda: pytest.fail("rebuilt"))
    assert again.cubin == e.cubin
    # a write that fails half-way leaves the old file and no temporary behind
    path = store.path("transpose", digest)
    before = open(path, "rb").read()

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        store._write(path, b"new bytes")
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(path), os.path.basename(path) + ".lock", "builds.log"])
    # damaged files fail their checks and are rebuilt
    for damage in (before[:-1], before[:20], b"", before[:-1] + bytes([before[-1] ^ 1])):
        with open(path, "wb") as f:
            f.write(damage)
        assert store.read("transpose", digest) is None
        e2 = store.get_or_build("transpose", digest, desc, _fake_build(digest))
        assert e2.entry == "fake_entry" and store.read("transpose", digest) is not None


def _racer(root, digest, desc, start):
    while time.time() < start:
        time.sleep(0.001)
    store = _cache.Store(root)
    e = store.get_or_build("quantize", digest, desc, _fake_build(digest))
    return store.builds, e.cubin


def test_four_concurrent_processes_build_once(tmp_path):
    """4 processes miss one key at the same moment: one builds, the others wait on its lock
    and read its bytes."""
    digest, desc = _cache.key("quantize", SPECS["quantize"], (9, 0))
    ctx = multiprocessing.get_context("fork")
    start = time.time() + 0.5
    with ctx.Pool(4) as pool:
        results = pool.starmap(_racer, [(str(tmp_path), digest, desc, start)] * 4)
    assert sum(b for b, _ in results) == 1
    assert len({c for _, c in results}) == 1
    log = [json.loads(line) for line in open(tmp_path / "builds.log")]
    assert [entry["digest"] for entry in log] == [digest]


def test_disable_switch_compiles_without_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8BLK_KERNEL_CACHE", "0")
    monkeypatch.setenv("FP8BLK_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(_cache, "compile_variant",
                        lambda f, s, cc: calls.append(f) or ("k", b"\x7fELFcubin"))
    assert not _cache.enabled()
    e = _cache.entry("transpose", SPECS["transpose"], (9, 0))
    e = _cache.entry("transpose", SPECS["transpose"], (9, 0))
    assert calls == ["transpose", "transpose"] and e.cubin == b"\x7fELFcubin"
    assert not os.path.exists(tmp_path / "cache")
    monkeypatch.setenv("FP8BLK_KERNEL_CACHE", "1")
    assert _cache.enabled()
    assert _cache.cache_dir() == str(tmp_path / "cache")
    monkeypatch.delenv("FP8BLK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache.cache_dir() == str(tmp_path / "xdg" / "fp8blk")


def test_simulator_flag_without_numba(monkeypatch):
    for value, want in (("1", True), ("2", True), ("0", False), ("", False), ("yes", False)):
        monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", value)
        assert sp.simulator_on() is want


_HIT_PATH = r"""
import json, sys
import fp8blk as fb
from fp8blk.kernels import _cache
from fp8blk.kernels import _specs as sp
from fp8blk.kernels import quantize as q
spec = q.spec_for(fb.Block1D(), sp.BF16, True, True, True, True)
digest, _ = _cache.key("quantize", spec, (9, 0))
entry = _cache.store().read("quantize", digest)
print(json.dumps({"digest": digest, "hit": entry is not None,
                  "numba": sorted(m for m in sys.modules
                                  if m.split(".")[0] == "numba" or m.endswith("_kernel")
                                  or m.endswith("._numba") or m.endswith("._kernel_lib"))}))
"""


def test_cache_hit_path_imports_no_numba(tmp_path):
    """Importing fp8blk and its kernels, making a call's spec and key and reading the stored
    cubin import neither numba nor any builder (a fresh process; the CuPy load and launch
    that follow are checked on the GPU, test_cache_gpu.py)."""
    env = dict(os.environ, FP8BLK_CACHE_DIR=str(tmp_path), PYTHONPATH=_REPO)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    first = json.loads(subprocess.run([sys.executable, "-c", _HIT_PATH], env=env, check=True,
                                      capture_output=True, text=True).stdout)
    assert not first["hit"]
    _, desc = _cache.key("quantize", SPECS["quantize"], (9, 0))
    _cache.Store(str(tmp_path)).get_or_build("quantize", first["digest"], desc,
                                             _fake_build(first["digest"]))
    out = json.loads(subprocess.run([sys.executable, "-c", _HIT_PATH], env=env, check=True,
                                    capture_output=True, text=True).stdout)
    assert out["hit"] and out["numba"] == [], out
