"""The conversion report (fp8blk/torch/report.py) on the CPU: what ``convert_to_float8_block``
converted and what it left, with why, per kind (linear, norm, mlp, experts, router), as data
(``conversion_report``) and as the converter's INFO lines; PEFT adapters found by name. The
model is hand-built from the shapes of transformers 5's modules (no download, no
transformers needed)."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import (Float8BlockConfig, conversion_report,  # noqa: E402
                          convert_to_float8_block)
from fp8blk.torch.report import KINDS, Kind, Left, adapter_fqns  # noqa: E402

from .test_mlp import GatedMLP  # noqa: E402
from .test_norm import GemmaStyleRMSNorm, HFStyleRMSNorm  # noqa: E402


class FusedMLP(torch.nn.Module):
    """Phi-3's MLP: one ``gate_up_proj`` for both halves."""

    def __init__(self, d=64, f=128):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(d, 2 * f, bias=False)
        self.down_proj = torch.nn.Linear(f, d, bias=False)
        self.activation_fn = torch.nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class Experts(torch.nn.Module):
    """transformers 5's ``MixtralExperts``: 3-D weights of its own, one slice per expert."""

    def __init__(self, n=4, d=64, f=128):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n, 2 * f, d))
        self.down_proj = torch.nn.Parameter(torch.randn(n, d, f))


class TopKRouter(torch.nn.Module):
    def __init__(self, n=4, d=64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, d))


class SparseMoeBlock(torch.nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.gate, self.experts = gate, Experts()


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "norm": HFStyleRMSNorm(64), "gemma": GemmaStyleRMSNorm(64), "ln": torch.nn.LayerNorm(64),
        "mlp": GatedMLP(64, 128), "fused": FusedMLP(),
        "moe": SparseMoeBlock(TopKRouter()), "old_moe": SparseMoeBlock(torch.nn.Linear(64, 4)),
        "lm_head": torch.nn.Linear(64, 128)})


def _not_head(module, fqn):
    return fqn != "lm_head"


def _facts(report):
    return {kind: (sorted(k.converted), sorted((e.fqn, e.type, e.reason) for e in k.left))
            for kind, k in report.kinds.items()}


_EXPERTS_LEFT = "not a transformers experts module (fp8blk.torch.moe.experts.is_experts_module)"


def test_report_says_what_was_converted_and_what_was_left_and_why(caplog):
    model = _model()
    # the mark fp8blk.torch.moe.convert_experts leaves on the experts it converts
    model["old_moe"].experts.fp8blk_config = Float8BlockConfig()
    before = conversion_report(model, _not_head)
    assert [e.reason for e in before["norm"].left if e.fqn == "norm"] == ["not converted yet"]
    with caplog.at_level(logging.INFO, logger="fp8blk.torch.convert"):
        convert_to_float8_block(model, module_filter_fn=_not_head)
    report = conversion_report(model, _not_head)
    assert _facts(report) == {
        "linear": (["fused.down_proj", "fused.gate_up_proj", "mlp.down_proj", "mlp.gate_proj",
                    "mlp.up_proj"],
                   [("lm_head", "Linear", "filtered out by module_filter_fn")]),
        "norm": (["norm"], [("gemma", "GemmaStyleRMSNorm", "(1 + weight) form not recognised"),
                            ("ln", "LayerNorm", "not an RMSNorm: no fp8blk path")]),
        "mlp": (["mlp"], [("fused", "FusedMLP", "fused gate_up_proj")]),
        # an nn.Linear router is converted by the Linear swap and reported as a router
        "router": (["old_moe.gate"], [("moe.gate", "TopKRouter", "kept in high precision")]),
        "experts": (["old_moe.experts"], [("moe.experts", "Experts", _EXPERTS_LEFT)])}
    assert report["norm"].line() == (
        "norm: 1 converted; 2 left: 1 GemmaStyleRMSNorm ((1 + weight) form not recognised): "
        "gemma; 1 LayerNorm (not an RMSNorm: no fp8blk path): ln")
    logged = [r.getMessage() for r in caplog.records if r.name == "fp8blk.torch.convert"]
    assert logged == [f"convert_to_float8_block: {line}" for line in report.lines()]
    assert [line.split(":")[0] for line in report.lines()] == [
        "linear", "norm", "mlp", "router", "experts"]


def test_options_off_and_names_cut_short():
    model = convert_to_float8_block(torch.nn.ModuleDict(
        {f"n{i}": HFStyleRMSNorm(64) for i in range(5)} | {"mlp": GatedMLP(64, 128)}),
        norms=False, gated_mlps=False)
    report = conversion_report(model, norms=False, gated_mlps=False)
    assert report["norm"].line() == ("norm: 0 converted; 5 left: 5 HFStyleRMSNorm "
                                     "(norms=False): n0, n1, n2, ...")
    assert report["mlp"].left == [Left("mlp", "GatedMLP", "gated_mlps=False")]
    assert report.lines() == [report[k].line() for k in ("linear", "norm", "mlp")]


def test_adapters_by_name_and_by_adapter_layer_names():
    from .test_convert import Adapted, LoraLinear

    model = torch.nn.ModuleDict({"q": LoraLinear(torch.nn.Linear(64, 64)),
                                 "s": Adapted(torch.nn.Linear(64, 64)),
                                 "lora_A": torch.nn.Linear(64, 8)})
    assert sorted(adapter_fqns(model)) == ["lora_A", "q.lora_A", "q.lora_B",
                                           "q.lora_embedding_A", "q.lora_embedding_B", "s.side"]
    convert_to_float8_block(model)
    report = conversion_report(model)
    assert sorted(report["linear"].converted) == ["q.base_layer", "s.base_layer"]
    assert sorted(e.fqn for e in report["linear"].left
                  if e.reason == "inside a PEFT adapter") == [
        "lora_A", "q.lora_A.default", "q.lora_B.default", "s.side"]


def test_a_kind_is_one_entry():
    """A converter for another kind adds one Kind to the table; its modules are matched
    before the kinds after it."""
    def is_moe(m, name, parent):
        return isinstance(m, SparseMoeBlock)
    kinds = (Kind("moe_block", lambda m, n, p: False, is_moe, lambda m: "not yet",
                  option="moe"),) + KINDS
    model = _model()
    report = conversion_report(model, kinds=kinds, moe=False)
    assert report["moe_block"].left == [Left("moe", "SparseMoeBlock", "moe=False"),
                                        Left("old_moe", "SparseMoeBlock", "moe=False")]
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        conversion_report("model")
