"""bench/bench_ep.py on 2 gloo ranks with tiny widths, one launch under a timeout, so that the
expert-parallel benchmark cannot rot between GPU runs: every case is in the JSON, the FP8
dispatch's received bytes passed the benchmark's own check against ``fb.quantize``, and the
bytes each rank sent are what the wire format says (docs/distributed.md, "All-to-all")."""
from __future__ import annotations

import json

import pytest

from bench.bench_ep import DISPATCH_CASES, LAYER_CASES, SHAPES

from ..comm.launch import ranks

pytestmark = pytest.mark.mpi
pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")

HIDDEN, WORLD = 256, 2
BLOCKS = HIDDEN // 128  # 1x128 scale blocks per row


def test_bench_ep_runs_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "ep.json"
    code, output, _ = ranks(WORLD, ["-m", "bench.bench_ep", "--device", "cpu", "--hidden",
                                    HIDDEN, "--intermediate", "128", "--experts", "8",
                                    "--top-k", "2", "--tokens", "64", "--steps", "1",
                                    "--warmup", "1", "--inner", "1", "--out", out],
                            timeout=300)
    assert code == 0, output[-8000:]
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["machine"] == "cpux2" and run["world"] == WORLD and "note" not in run
    assert "bench.bench_ep" in run["command"] and run["date"]
    cases = {(c["part"], c["shape"], c.get("routing"), c["case"]): c for c in result["cases"]}
    want = {("dispatch", s, r, c) for s in SHAPES for r in ("balanced", "skewed")
            for c in DISPATCH_CASES}
    want |= {("layer", s, None, c) for s in SHAPES for c in LAYER_CASES}
    assert set(cases) == want

    for (part, shape, routing, case), c in cases.items():
        assert all(t > 0 for t in c["host_ms_per_rank"]) and c["gpu_ms"] is None
        if part != "dispatch":
            continue
        # one metadata all_gather per call: a row of 10 + 2 * world int64s, never counted
        # with the data
        assert c["meta_bytes_sent"] == 8 * (10 + 2 * WORLD)
        bf16 = cases[("dispatch", shape, routing, "bf16")]["bytes_sent_per_rank"]
        if case == "combine":  # the received rows go back as they are
            assert c["bytes_sent"] == c["rows_sent"] * 2 * HIDDEN
            continue
        scale_bytes = {"fp8_pow2": 1, "fp8_fp32": 4, "bf16": None}[case]
        if scale_bytes is None:
            assert c["bytes_sent"] == c["rows_sent"] * 2 * HIDDEN
            continue
        assert c["byte_check_per_rank"] == [True] * WORLD
        # per rank: one FP8 byte per element and one scale per 1x128 block, against bf16's 2
        assert c["bytes_sent_per_rank"] == [b * (HIDDEN + scale_bytes * BLOCKS) // (2 * HIDDEN)
                                            for b in bf16]
        bound = 0.51 if case == "fp8_pow2" else 0.52
        assert 0.5 < c["bytes_sent_vs_bf16_max_rank"] <= bound, c

    for shape in SHAPES:
        layer = {case: cases[("layer", shape, None, case)] for case in LAYER_CASES}
        assert layer["fp8blk"]["param_gib"] == layer["bf16"]["param_gib"]
        # expert-parallel blocks keep half the experts of the two ranks (the router whole)
        # and compute what the whole converted block does (the parity tests bound it; a wrong
        # shard or route here gives a difference of the outputs' own size)
        for case in ("ep_fp8", "ep_bf16"):
            assert layer[case]["param_gib"] < 0.6 * layer["bf16"]["param_gib"], layer
            assert max(layer[case]["out_diff_vs_fp8blk_per_rank"]) <= 1e-2, layer[case]
