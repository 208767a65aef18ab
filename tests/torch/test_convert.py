"""The whole-model converter, ``convert_to_float8_block`` (fp8blk/torch/convert.py), on the
CPU: the filter and in-place contract, the recipe-instead-of-config error, a second conversion
with another config, the keep_inputs name rules, the default (every option on; each switches
its part off), a conversion on the meta device equal to an eager one after ``to_empty`` and
the model's init, and PEFT adapters left alone. Tiny Hugging Face Llamas (1-2 layers, hidden
128) where transformers is installed."""
import pytest
import torch

import fp8blk as fb
from fp8blk.torch import (Float8BlockConfig, Float8BlockLinear, conversion_report,
                          convert_to_float8_block)

from ._parity import FeedForward
from .test_mlp import GatedMLP


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
    for kw in ({"keep_inputs": False}, {"keep_inputs": True, "gated_mlps": False},
               {"keep_inputs": True, "gated_mlps": True},
               {"keep_inputs": True, "gated_mlps": True,
                "module_filter_fn": lambda m, fqn: fqn != "attn.o_proj"}, {}):
        m = convert_to_float8_block(model(), **kw)
        kept[len(kept)] = sorted(f for f, mod in m.named_modules()
                                 if isinstance(mod, Float8BlockLinear) and mod.keep_input)
    assert kept == {0: [], 1: ["attn.o_proj"], 2: ["attn.o_proj", "mlp.down_proj"],
                    3: ["mlp.down_proj"], 4: ["attn.o_proj", "mlp.down_proj"]}   # 4: default


# -- tiny Hugging Face models ----------------------------------------------------------------

def _hf(arch="llama", layers=2, device=None):
    transformers = pytest.importorskip("transformers")
    cfg = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=1, head_dim=64, vocab_size=128, num_hidden_layers=layers)
    cls, config = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                   "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig)}[arch]
    if device is None:
        torch.manual_seed(0)
        return cls(config(**cfg))
    with torch.device(device):
        return cls(config(**cfg))


def _not_head(module, fqn):
    return not fqn.endswith("lm_head")


def _types(model):
    return {fqn: type(m).__name__ for fqn, m in model.named_modules()}


def test_default_is_every_option_and_options_switch_parts_off():
    from fp8blk.torch.mlp import Float8BlockGatedMLP
    from fp8blk.torch.norm import Float8BlockRMSNorm

    def parts(model):
        mods = list(model.modules())
        return (sum(isinstance(m, Float8BlockLinear) for m in mods),
                sum(isinstance(m, Float8BlockRMSNorm) for m in mods),
                sum(isinstance(m, Float8BlockGatedMLP) for m in mods),
                sum(isinstance(m, Float8BlockLinear) and m.keep_input for m in mods),
                getattr(model, "_fp8blk_share_installed", False))

    got = {name: parts(convert_to_float8_block(_hf(layers=1), module_filter_fn=_not_head,
                                               **kw))
           for name, kw in [("default", {}), ("norms", {"norms": False}),
                            ("mlps", {"gated_mlps": False}), ("keep", {"keep_inputs": False}),
                            ("share", {"share_quantize": False}),
                            ("linears", {"share_quantize": False, "norms": False,
                                         "gated_mlps": False, "keep_inputs": False})]}
    # 1 layer: 7 linears (lm_head filtered), 3 norms, 1 MLP; kept: o_proj and down_proj
    assert got == {"default": (7, 3, 1, 2, True), "norms": (7, 0, 1, 2, True),
                   "mlps": (7, 3, 0, 1, True), "keep": (7, 3, 1, 0, True),
                   "share": (7, 3, 1, 2, False), "linears": (7, 0, 0, 0, False)}


def _step_bytes(model):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_meta_conversion_equals_eager(arch):
    """Converted on the meta device, then ``to_empty`` and HF's init: the module types, the
    parameters' bytes and a training step's loss and gradients equal an eager conversion of
    the same model (built on meta, materialized, initialized, then converted). Gemma's norms
    are left in both (their ``1 + weight`` form fails the probe), its MLP swapped."""
    ref = _hf(arch, device="meta").to_empty(device="cpu")
    torch.manual_seed(2)
    ref.init_weights()
    convert_to_float8_block(ref, module_filter_fn=_not_head)

    meta = _hf(arch, device="meta")
    convert_to_float8_block(meta, module_filter_fn=_not_head)
    # the report reads meta modules as the converter does (Gemma's norms: the same reason)
    assert conversion_report(meta, _not_head).lines() == conversion_report(
        ref, _not_head).lines()
    meta.to_empty(device="cpu")
    torch.manual_seed(2)
    meta.init_weights()

    assert _types(meta) == _types(ref)
    norms = sum(type(m).__name__ == "Float8BlockRMSNorm" for m in ref.modules())
    assert norms == (5 if arch == "llama" else 0)
    assert sum(type(m).__name__ == "Float8BlockGatedMLP" for m in ref.modules()) == 2
    for (a, m), n in zip(ref.named_modules(), meta.modules()):
        assert getattr(m, "keep_input", None) == getattr(n, "keep_input", None), a
        assert getattr(m, "silu", None) == getattr(n, "silu", None), a
    sa, sb = ref.state_dict(), meta.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    for a, b in zip(_step_bytes(ref), _step_bytes(meta)):
        assert torch.equal(a, b)


class LoraLinear(torch.nn.Module):
    """PEFT's LoRA ``Linear`` as fp8blk's rule reads it (peft/tuners/lora/layer.py, cited in
    fp8blk/torch/report.py): the frozen ``base_layer``, adapters in ``lora_A`` / ``lora_B``
    ModuleDicts, the class attribute ``adapter_layer_names`` and the ``weight`` property."""

    adapter_layer_names = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")

    def __init__(self, base, r=8):
        super().__init__()
        self.base_layer = base
        base.requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, r,
                                                                      bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, base.out_features,
                                                                      bias=False)})
        self.lora_embedding_A = torch.nn.ParameterDict()
        self.lora_embedding_B = torch.nn.ParameterDict()

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * 2.0


class Adapted(torch.nn.Module):
    """A module whose adapter child is named only by ``adapter_layer_names`` (not lora_*)."""

    adapter_layer_names = ("side",)

    def __init__(self, base, side=None):
        super().__init__()
        self.base_layer = base
        self.side = torch.nn.Linear(base.in_features, base.out_features) if side is None \
            else side

    def forward(self, x):
        return self.base_layer(x) + self.side(x)


def _with_lora(model):
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                setattr(parent, name, LoraLinear(child))
    return model


def test_peft_adapters_left_alone():
    """LoRA on every projection of a 2-layer Llama: the 14 base layers are converted, the 28
    adapter layers stay nn.Linear (``adapters=True`` converts them too); a child named in
    ``adapter_layer_names`` is left as well; the model trains."""
    model = _with_lora(_hf())
    lora = [m for m in model.modules() if isinstance(m, LoraLinear)]
    adapter_layers = [a for m in lora for a in (m.lora_A["default"], m.lora_B["default"])]
    convert_to_float8_block(model, module_filter_fn=_not_head)
    fp8 = [m for m in model.modules() if isinstance(m, Float8BlockLinear)]
    assert len(lora) == 14 and len(fp8) == 14
    assert all(isinstance(m.base_layer, Float8BlockLinear) for m in lora)
    assert all(type(a) is torch.nn.Linear for m in lora for a in (m.lora_A["default"],
                                                                   m.lora_B["default"]))
    assert sum(type(m).__name__ == "Float8BlockGatedMLP" for m in model.modules()) == 2
    loss = model(input_ids=torch.arange(32).view(2, 16), labels=torch.arange(32).view(2, 16)).loss
    loss.backward()
    assert all(a.weight.grad is not None for a in adapter_layers)
    assert all(m.base_layer.weight.grad is None for m in lora)

    every = convert_to_float8_block(_with_lora(_hf(layers=1)), module_filter_fn=_not_head,
                                    adapters=True)
    assert sum(isinstance(m, Float8BlockLinear) for m in every.modules()) == 21

    side = torch.nn.Sequential(Adapted(torch.nn.Linear(64, 64)),
                               Adapted(torch.nn.Linear(64, 64), GatedMLP(64, 128)))
    convert_to_float8_block(side)
    assert isinstance(side[0].base_layer, Float8BlockLinear)
    assert type(side[0].side) is torch.nn.Linear
    # nothing inside an adapter is swapped: nor its norms or MLPs (nor their linears)
    assert type(side[1].side) is GatedMLP and type(side[1].side.up_proj) is torch.nn.Linear
    assert side(torch.randn(4, 64)).shape == (4, 64)
