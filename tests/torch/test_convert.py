"""The whole-model converter, ``convert_to_float8_block`` (fp8blk/torch/convert.py), on the
CPU: the filter and in-place contract, the recipe-instead-of-config error, a second conversion
with another config, and the keep_inputs name rules."""
import pytest
import torch

import fp8blk as fb
from fp8blk.torch import Float8BlockConfig, Float8BlockLinear, convert_to_float8_block

from ._parity import FeedForward


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 32))


def test_converter_filter_and_in_place():
    model = FeedForward(256, 384)
    w = model.w1.weight
    out = convert_to_float8_block(model, module_filter_fn=lambda m, fqn: fqn != "out_proj")
    assert out is model and isinstance(model.w1, Float8BlockLinear)
    assert model.w1.weight is w and type(model.out_proj) is torch.nn.Linear
    with pytest.raises(TypeError, match="in place"):
        convert_to_float8_block(torch.nn.Linear(4, 4))


def test_recipe_as_config_names_the_fix():
    with pytest.raises(TypeError, match=r"wrap it, e.g. Float8BlockConfig\(activation="):
        convert_to_float8_block(_model(), fb.Block1D())


def test_second_convert_with_another_config_raises_and_same_config_keeps():
    model = convert_to_float8_block(_model())
    first = model[0]
    assert convert_to_float8_block(model) is model and model[0] is first   # same config
    e5m2 = Float8BlockConfig(grad=fb.Block1D(fb.E5M2))
    with pytest.raises(ValueError, match=r"layer '0' is a Float8BlockLinear with config"):
        convert_to_float8_block(model, e5m2)
    assert model[0].config == Float8BlockConfig()
    # a filter leaving the converted layers out lets another config convert the rest; the
    # filter is asked about linear layers only (it may read their attributes)
    model.add_module("3", torch.nn.Linear(32, 32))
    convert_to_float8_block(model, e5m2, lambda m, fqn: m.in_features == 32 and fqn == "3")
    assert model[3].config == e5m2 and model[0].config == Float8BlockConfig()


def test_convert_keep_inputs_sets_output_and_down_projections():
    """keep_inputs: an o_proj beside a q_proj (attention) and a swapped gated MLP's
    down_proj keep their input; every other layer, and an o_proj without a q_proj sibling,
    keeps the FP8 copy; module_filter_fn leaves a layer as it is."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
            self.o_proj = torch.nn.Linear(64, 64)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(64, 128), torch.nn.Linear(64, 128)
            self.down_proj, self.act_fn = torch.nn.Linear(128, 64), torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def model():
        return torch.nn.ModuleDict({"attn": Attention(), "mlp": MLP(), "other": torch.nn.ModuleDict(
            {"o_proj": torch.nn.Linear(64, 64)})})

    kept = {}
    for kw in ({}, {"keep_inputs": True}, {"keep_inputs": True, "gated_mlps": True},
               {"keep_inputs": True, "gated_mlps": True,
                "module_filter_fn": lambda m, fqn: fqn != "attn.o_proj"}):
        m = convert_to_float8_block(model(), **kw)
        kept[len(kept)] = sorted(f for f, mod in m.named_modules()
                                 if isinstance(mod, Float8BlockLinear) and mod.keep_input)
    assert kept == {0: [], 1: ["attn.o_proj"], 2: ["attn.o_proj", "mlp.down_proj"],
                    3: ["mlp.down_proj"]}
