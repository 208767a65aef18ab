"""The kernels' door (fp8blk/kernels/backend.py): ``python -m fp8blk prebuild``
(fp8blk/cli/prebuild.py over backend's prebuild functions) on the CPU: real kernel variants
compile through the one compile route into cubin files of the cache, deterministically, and a
second run finds them cached."""
import os
import subprocess
import sys

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compiling cubins needs the real Numba CUDA target, not the simulator",
                allow_module_level=True)

from fp8blk.cli import prebuild as cli_prebuild  # noqa: E402
from fp8blk.kernels import _cache  # noqa: E402
from fp8blk.kernels import _specs as sp  # noqa: E402
from fp8blk.kernels import backend  # noqa: E402
from fp8blk.kernels._numba import cubin_entries  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prebuild_two_real_variants(tmp_path, capsys):
    variants = [("transpose", sp.TransposeSpec(True, True)),
                ("dequantize", sp.DequantizeSpec(sp.MXFP8, False, True, sp.F32_OUT, sp.ROWS))]
    summary = cli_prebuild.prebuild((9, 0), jobs=2, root=str(tmp_path), variants=variants)
    assert summary["errors"] == [] and summary["compiled"] == 2, summary
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".cubin"))
    assert [f.split("-")[0] for f in files] == ["dequantize", "transpose"]
    store = _cache.Store(str(tmp_path))
    for family, spec in variants:
        digest, desc = _cache.key(family, spec, (9, 0))
        e = store.read(family, digest)
        assert e is not None and e.meta["key"] == desc
        assert e.cubin[:4] == b"\x7fELF" and cubin_entries(e.cubin) == [e.entry]
        assert f"kernel_{family}" in e.entry   # profilers filter on "^kernel"
    # the compile route is deterministic: a fresh compile gives the stored bytes
    family, spec = variants[0]
    assert _cache.compile_variant(family, spec, (9, 0))[1] == \
        store.read(family, _cache.key(family, spec, (9, 0))[0]).cubin
    again = cli_prebuild.prebuild((9, 0), jobs=2, root=str(tmp_path), variants=variants)
    assert (again["compiled"], again["already_cached"]) == (0, 2)
    assert "2/2 variants" in capsys.readouterr().out


def test_common_variants_and_cli_arguments():
    variants = backend.common_variants()
    families = [f for f, _ in variants]
    # 3 recipes x 2 formats x 3 input dtypes x 3 directions; 3 x 2 x 2 directions x 3 outputs
    assert families.count("quantize") == 54 and families.count("dequantize") == 36
    assert families.count("transpose") == 1
    # a default Linear's groups: 3 input dtypes x (2 forward + 3 backward)
    assert families.count("quantize_group") == 15
    assert len({_cache.key(f, s, (9, 0))[0] for f, s in variants}) == len(variants)
    assert all(s.vec and s.col_vec for f, s in variants if f == "quantize")
    assert all(s.path != sp.SCALAR and s.piece == 0 for f, s in variants if f == "dequantize")
    assert cli_prebuild.parse_cc("90") == (9, 0) and cli_prebuild.parse_cc("10.0") == (10, 0)
    assert cli_prebuild.parse_cc("sm_90a") == (9, 0) and cli_prebuild.parse_cc("120") == (12, 0)
    with pytest.raises(ValueError, match="--cc"):
        cli_prebuild.parse_cc("nine")
    out = subprocess.run([sys.executable, "-m", "fp8blk", "prebuild", "--help"], cwd=_REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "--cc" in out and "--jobs" in out and "--dir" in out


def test_prebuild_refuses_when_the_cache_is_off(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8BLK_KERNEL_CACHE", "0")
    with pytest.raises(RuntimeError, match="FP8BLK_KERNEL_CACHE"):
        cli_prebuild.prebuild((9, 0), root=str(tmp_path), variants=[])
