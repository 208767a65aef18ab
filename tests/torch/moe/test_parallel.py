"""Expert parallelism (fp8blk.torch.moe.parallel): in-process checks on a one-rank MPI
communicator, and one launch of 4 gloo ranks (tests/torch/scripts/ep_worker.py, whose docstring
lists its checks: P=4 and P=2 against the single-rank module and model, EP x FSDP2 on a 2x2
mesh, bad input on every rank) under a timeout."""
import copy
import functools
import os
from pathlib import Path

import pytest
import torch

from fp8blk.torch.linear.functional import quantize_buffers
from fp8blk.torch.moe import convert_experts, expert_parallel
from fp8blk.torch.moe.routing import permute, route
from fp8blk.torch.scaled_mm import dequantize_operand

from ...comm.launch import ranks, suite_passes
from ._reference import experts_module, routing_ids, tiny_model

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "ep_worker.py"
BAD = ("differing_models", "uneven_experts", "unconverted", "expert_id", "hidden_size",
       "dtype")


def _self_comm():
    mpi = pytest.importorskip("mpi4py.MPI")
    from fp8blk.comm import MPIComm
    return MPIComm(mpi.COMM_SELF)


def _experts(arch="qwen3_moe"):
    model = tiny_model(arch)
    convert_experts(model)
    return experts_module(model)


def _run(module, hidden, idx, weights, dout):
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = module(hidden, idx, weights)
    out.backward(dout)
    grads = [p.grad for p in module.parameters()]
    return [out, hidden.grad, weights.grad] + grads


def _inputs(tokens=300, experts=8, kind="skewed"):
    gen = torch.Generator().manual_seed(7)
    hidden = (torch.randn(tokens, 256, generator=gen)
              * 10.0 ** (torch.rand(1, 256, generator=gen) * 4 - 2)).bfloat16()
    idx = routing_ids(tokens, 2, experts, kind)
    weights = torch.rand(tokens, 2, generator=gen).bfloat16()
    return hidden, idx, weights, torch.randn(tokens, 256, generator=gen).bfloat16()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_one_rank_bf16_dispatch_is_the_single_rank_path(arch):
    # one rank: every expert's rows in token order, as the single-rank path lays them out;
    # with the dispatch in bf16 every byte is the single-rank path's (outputs, input and
    # router-weight gradients, weight and bias gradients)
    base = _experts(arch)
    ep = copy.deepcopy(base)
    expert_parallel(ep, _self_comm(), fp8_dispatch=False)
    args = _inputs(experts=base.num_experts)
    for got, want in zip(_run(ep, *args), _run(base, *args)):
        assert torch.equal(got, want)


def test_fp8_dispatch_operand_is_quantize_of_the_padded_rows():
    # the dispatched FP8 rows laid out in the padded segments (zero rows' bytes and scales
    # for the padding) are fb.quantize of the padded high-precision rows, byte for byte
    base = _experts()
    ep = copy.deepcopy(base)
    names = expert_parallel(ep, _self_comm(), fp8_dispatch=True)
    assert names == [""]
    hidden, idx, _, _ = _inputs()
    state = ep.fp8blk_ep
    plan = state.plan(hidden, idx)
    recipe = base.fp8blk_config.activation
    data, scale, col, col_scale, high = state.dispatch(hidden[plan.token_of], plan, recipe,
                                                       True, True)
    padded = permute(hidden, route(idx, base.num_experts))[:plan.routing.rows]
    want = quantize_buffers(padded.contiguous(), recipe, True, False)
    assert torch.equal(data, want[0]) and torch.equal(scale, want[1])
    # the high-precision rows the columnwise copy is made from: the FP8 rows' values
    assert torch.equal(high, dequantize_operand(data.view(torch.float8_e4m3fn), scale, "1x128"))
    from_high = quantize_buffers(high, recipe, False, True)
    assert torch.equal(col, from_high[2]) and torch.equal(col_scale, from_high[3])


def test_fp8_dispatch_sends_half_the_bytes():
    # the dispatch's data collective moves 1 byte per element plus one byte per 1x128 scale
    # (power-of-two scales), against 2 for the bf16 dispatch; the combine is bf16 both ways
    counts = {}
    for fp8 in (True, False):
        ep = copy.deepcopy(_experts())
        comm = _self_comm()
        expert_parallel(ep, comm, fp8_dispatch=fp8)
        comm.reset_stats()
        hidden, idx, weights, _ = _inputs()
        with torch.no_grad():
            ep(hidden, idx, weights)
        counts[fp8] = comm.stats.as_dict()["ops"]
    rows = 300 * 2
    assert counts[True]["quantized_all_to_all"] == [1, rows * (256 + 2)]
    assert counts[False]["high_precision_all_to_all"] == [2, 2 * rows * 256 * 2]
    assert counts[True]["high_precision_all_to_all"] == [1, rows * 256 * 2]


def test_errors():
    comm = _self_comm()
    with pytest.raises(ValueError, match="convert it first"):
        expert_parallel(tiny_model("qwen3_moe"), comm)
    ep = _experts()
    expert_parallel(ep, comm)
    with pytest.raises(ValueError, match="expert-parallel already"):
        expert_parallel(ep, comm)
    hidden, idx, weights, _ = _inputs()
    with pytest.raises(ValueError, match="outside"):
        ep(hidden, idx + 8, weights)
    with pytest.raises(TypeError, match="integer expert ids"):
        ep(hidden, idx.float(), weights)
    with pytest.raises(ValueError, match="hidden_states"):
        ep(hidden[:10], idx, weights)
    # the group goes on after an error: a correct call works
    assert ep(hidden, idx, weights).shape == hidden.shape


@functools.lru_cache(maxsize=None)
def _launch():
    seed = str(int.from_bytes(os.urandom(4), "little") >> 1)
    code, output, _ = ranks(4, [WORKER], timeout=400, env={"FP8BLK_SEED": seed})
    assert code == 0 and suite_passes(output) == 4, f"seed={seed}\n{output[-8000:]}"
    return seed, output


@pytest.mark.mpi
def test_expert_parallel_on_four_and_two_gloo_ranks():
    seed, output = _launch()
    print(f"seed={seed}")
    for part in ("experts", "model", "EP x FSDP2"):
        assert output.count(f"{part} cases passed") == 4, output[-8000:]


@pytest.mark.mpi
def test_bad_inputs_raise_on_every_rank():
    # each case twice per rank: on the 4 ranks and on its pair of 2
    seed, output = _launch()
    print(f"seed={seed}")
    for name in BAD:
        assert output.count(f"bad {name} raised") == 8, (name, output[-8000:])
