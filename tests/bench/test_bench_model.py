"""bench/bench_model.py's ``--combine`` (CPU): a combined file combined again with a new run
keeps one flat list of commands, one run entry per run, and the later case of the same arch,
variant, mode and layer count, with the ratios against bf16 recomputed."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
from bench import bench_model  # noqa: E402


def _case(variant, step_ms, layers=8):
    tokens = 8192
    return {"arch": "mixtral", "variant": variant, "mode": "eager", "layers": layers,
            "step_ms": step_ms, "tokens_per_s": tokens / step_ms * 1e3, "peak_bytes": 100,
            "saved_bytes": 10, "held_bytes": 10, "host_ms": 1.0, "cpu_ms": step_ms}


def _run(path, date, command, cases):
    path.write_text(json.dumps({"machine": "GPU", "date": date, "command": command,
                                "cases": cases}))
    return str(path)


def test_combine_twice_keeps_commands_flat_and_takes_the_later_case(tmp_path, capsys):
    a = _run(tmp_path / "a.json", "d1", "cmd a", [_case("bf16", 200.0), _case("fp8", 160.0)])
    b = _run(tmp_path / "b.json", "d2", "cmd b", [_case("fp8", 100.0)])
    c = _run(tmp_path / "c.json", "d3", "cmd c", [_case("bf16", 400.0, layers=4)])
    first = tmp_path / "ab.json"
    bench_model.combine([a, b], str(first))
    out = bench_model.combine([str(first), c], None)
    capsys.readouterr()
    assert out["command"] == ["cmd a", "cmd b", "cmd c"]
    assert [r["date"] for r in out["runs"]] == ["d1", "d2", "d3"]
    assert all(isinstance(r["command"], str) for r in out["runs"])
    by = {(x["variant"], x["layers"]): x for x in out["cases"]}
    assert len(by) == 3 and by[("fp8", 8)]["step_ms"] == 100.0
    assert by[("fp8", 8)]["speedup_vs_bf16"] == pytest.approx(2.0)
