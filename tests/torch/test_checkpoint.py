"""Checkpoints of FSDP2 FP8-weight models (fp8blk/torch/checkpoint.py and the weights'
pickling), on the CPU with gloo: ``scripts/checkpoint_worker.py`` (its docstring lists
every check) saves a trained model with torch.distributed.checkpoint and torch.save, loads it
into an unconverted model and into a second FP8 model, and resumes training bit for bit."""
from pathlib import Path

import pytest

from ..comm.launch import ranks, suite_passes

pytestmark = pytest.mark.mpi
pytest.importorskip("torch.distributed")

WORKER = Path(__file__).resolve().parent / "scripts" / "checkpoint_worker.py"


def test_checkpoint_save_load_resume_two_ranks(rng, tmp_path):
    seed = str(int(rng.integers(2 ** 31)))
    code, output, _ = ranks(2, [WORKER, "cast:block2d", "primary:block2d", "cast:mxfp8",
                                "primary:mxfp8"], timeout=300,
                            env={"FP8BLK_SEED": seed, "FP8BLK_CKPT_DIR": str(tmp_path)})
    assert code == 0 and suite_passes(output) == 2, output[-8000:]


def test_checkpoint_fsdp2_x_tp_four_ranks(rng, tmp_path):
    seed = str(int(rng.integers(2 ** 31)))
    code, output, _ = ranks(4, [WORKER, "tp"], timeout=300,
                            env={"FP8BLK_SEED": seed, "FP8BLK_CKPT_DIR": str(tmp_path)})
    assert code == 0 and suite_passes(output) == 4, output[-8000:]


@pytest.mark.parametrize("mode", ["cast", "primary"])
def test_state_dict_pickles_as_plain_high_precision_values(mode, rng):
    """Without FSDP2 (one process): torch.save of a prepared model stores plain tensors, the
    parameter (cast) or the FP8 weight dequantized (primary); rows and columns span orders
    of magnitude, so every 128x128 tile has its own scale."""
    import io

    import torch

    import fp8blk as fb
    from fp8blk.torch import Float8BlockConfig, convert_to_float8_block
    from fp8blk.torch import fsdp as F

    from ._parity import spread

    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    model = torch.nn.Sequential(torch.nn.Linear(384, 300, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(spread((300, 384), gen))
    w0 = model[0].weight.detach().clone()
    convert_to_float8_block(model, Float8BlockConfig(), share_quantize=False)
    F.prepare_fsdp_fp8(model, mode=mode)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    got = torch.load(buf)["0.weight"]
    want = w0 if mode == "cast" else \
        fb.quantize(w0.to(torch.bfloat16), fb.Block2D()).dequantize(torch.float32)
    assert type(got) is torch.Tensor and got.dtype == torch.float32
    assert torch.equal(got, want)
    if mode == "primary":
        assert not torch.equal(got, w0)  # the FP8 values, not the weight it was made from
