"""FSDP2 with FP8 weights on the CPU (gloo), one launch of 2 ranks and one of 4, under a timeout.

The worker (``tests/torch/scripts/fsdp_worker.py``, whose docstring lists every check) trains a
3-layer Float8BlockLinear model for 5 steps per case and compares with a single-process
reference on every rank (and the FeedForward parity of tests/torch/_parity.py, FSDP2 alone and FSDP2 x TP):
bytes and scales after every all-gather, usage per pass, bytes on
the wire, and losses/gradients/parameters bit for bit. Cases are ``mode:recipe:reshard``
(Float8BlockLinear asks the weight for rowwise data in the forward pass and for columnwise
data in the backward pass: MXFP8 with reshard_after_forward=True needs that). Shapes: 384 rows (192 per rank on 2, 96 on 4: shards cut 128-row tiles), 300 rows
(75 per rank on 4), 290 rows on 4 ranks (73+73+73+71: FSDP pads), MXFP8 288 rows (72 per
rank, cutting 32-row blocks).
"""
import functools
import json
import os
import sys
from pathlib import Path

import pytest

from ...comm.launch import ranks, run, suite_passes

pytestmark = pytest.mark.mpi
pytest.importorskip("torch.distributed")

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_worker.py"


# the cases of each world size, in one launch (the mismatch cases first: every rank raises
# and the group goes on); a fresh seed per session, printed by every test that reads it
CASES = {2: ("mismatch:cast", "mismatch:primary", "errors", "clip", "compile", "meta",
             "cast:block2d:1", "primary:block2d:0", "cast:mxfp8:0", "primary:mxfp8:1", "ffn"),
         4: ("mismatch:cast", "mismatch:primary", "primary:block2d:1", "cast:block2d:0",
             "primary:mxfp8:0", "cast:mxfp8:1", "ffn_tp")}


@functools.lru_cache(maxsize=None)
def _launch(n):
    """(seed, output) of the worker on n ranks with CASES[n], launched once per session."""
    seed = str(int.from_bytes(os.urandom(4), "little") >> 1)
    code, output, _ = ranks(n, [WORKER, *CASES[n]], timeout=400, env={"FP8BLK_SEED": seed})
    assert code == 0 and suite_passes(output) == n, f"seed={seed}\n{output[-8000:]}"
    return seed, output


def test_fsdp_fp8_weights_two_ranks():
    # both modes, both recipes, reshard_after_forward True and False, the error cases,
    # clip_master_grad_norm_, torch.compile, a meta-device init
    # + the FSDP2 parity of the FeedForward (fully_shard on projections and parent)
    seed, _ = _launch(2)
    print(f"seed={seed}")


def test_fsdp_fp8_weights_four_ranks_uneven():
    # + FSDP2 x TP on a 2x2 (dp, tp) mesh against TP alone
    seed, _ = _launch(4)
    print(f"seed={seed}")


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_ranks_with_other_layer_shapes_raise_on_every_rank(n):
    # rank 0 builds 384 rows where the others build 512: every rank raises fp8blk's
    # ValueError at the first all-gather, before the tile-scale all-reduce (mode "cast") or
    # FSDP2's all-gather (mode "primary"), which ranks would otherwise enter with other
    # sizes or not at all (a hang or a gloo abort); the launch's timeout turns a hang into
    # a failure
    seed, out = _launch(n)
    print(f"seed={seed}")
    for mode in ("cast", "primary"):
        assert out.count(f"mismatch {mode} raised ValueError") == n, out[-8000:]


def test_bench_fsdp_runs_on_the_cpu(tmp_path):
    """The FSDP2 benchmark's own code (four cases built up front, interleaved timed steps, the
    byte checks after every all-gather, the hook and cast breakdown, the JSON) on 2 gloo
    ranks with tiny layers, so that it cannot rot between GPU runs."""
    out = tmp_path / "fsdp.json"
    code, output, _ = ranks(2, ["-m", "bench.bench_fsdp", "--device", "cpu", "--width", "256",
                                "--tokens", "128", "--steps", "2", "--warmup", "1",
                                "--out", out], timeout=300)
    assert code == 0, output[-8000:]
    cases = {c["case"]: c for c in json.loads(out.read_text())["cases"]}
    assert sorted(cases) == ["bf16", "bf16_master", "cast", "primary"]
    for mode in ("primary", "cast"):
        c = cases[mode]
        assert c["byte_checks_passed"] == 8  # 4 layers, forward and backward gathers
        assert c["bytes_vs_bf16"] == 0.5 and c["hook_bytes_per_step"] == c["bytes_sent_per_step"]
        assert c["hook_calls_per_step"] == {"pre": 8, "post": 8}
    assert cases["bf16_master"]["bytes_vs_bf16"] == 1.0
    assert all(len(c["step_gpu_ms_all"]) == 0 and c["step_host_ms"] > 0 for c in cases.values())


@pytest.mark.gpu
def test_fsdp_fp8_weights_one_gpu_nccl():
    # the benchmark's byte checks (every gather vs quantize(bf16(full weight))) on one GPU,
    # small shapes; the full benchmark is bench/bench_fsdp.py
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=1", "-m", "bench.bench_fsdp", "--width", "1024", "--layers", "2",
               "--tokens", "512", "--steps", "2", "--warmup", "1"]
    code, output, _ = run(command, 600)
    assert code == 0, output[-8000:]
    assert output.count('"byte_checks_passed": 4') == 2, output[-8000:]  # primary, cast
