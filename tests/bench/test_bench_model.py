"""bench/bench_model.py on the CPU: ``--combine`` (a combined file combined again with a new
run keeps one flat list of commands, one run entry per run, and the later case of the same
arch, variant, mode and layer count, with the ratios against bf16 recomputed, the peak floor
among them), ``state_bytes`` (parameters, gradients and AdamW's state, counted), and where a
run without ``--out`` writes."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
from bench import bench_model  # noqa: E402


def _case(variant, step_ms, layers=8):
    tokens = 8192
    return {"arch": "mixtral", "variant": variant, "mode": "eager", "layers": layers,
            "step_ms": step_ms, "tokens_per_s": tokens / step_ms * 1e3, "peak_bytes": 100,
            "saved_bytes": 10, "held_bytes": 10, "host_ms": 1.0, "cpu_ms": step_ms,
            "state_bytes": 80}


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
    assert by[("fp8", 8)]["peak_floor_vs_bf16"] == pytest.approx(0.8)
    assert by[("bf16", 4)]["peak_floor_vs_bf16"] == pytest.approx(0.8)   # bf16's own floor


def test_state_bytes_counts_parameters_gradients_and_adamw_state():
    import torch
    model = bench_model.build_model("llama", "bf16", 1, 32, "cpu", tiny=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    step, opt = bench_model.make_step(model, ids)
    params = list(model.parameters())
    step()
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    assert all(p.dtype == torch.bfloat16 for p in params)
    # the parameters and their gradients; AdamW's two moments in the parameters' dtype and
    # its step count, a float32 scalar per parameter
    assert bench_model.state_bytes(params, opt) == 4 * p_bytes + 4 * len(params)


def test_a_tiny_or_cpu_run_does_not_replace_the_results_file():
    import torch
    assert bench_model.default_out(torch.device("cuda"), tiny=True) is None
    assert bench_model.default_out(torch.device("cpu"), tiny=False) is None
    assert bench_model.default_out(torch.device("cuda"), tiny=False).endswith(
        "bench/results/model-h200.json")
