"""Quantize once per activation (fp8blk/torch/linear/sharing.py) on the CPU: sibling layers
share one quantization, with the bytes of the unshared path, safely under in-place updates,
no-grad passes and activation checkpointing; and a tiny config-built Hugging Face Llama
(skipped without transformers) converted and trained 3 steps with sharing, the
Float8BlockRMSNorm and the Float8BlockGatedMLP, byte-equal to the unshared path with the same
swaps, with fewer saved bytes than bf16."""
from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import convert_to_float8_block  # noqa: E402
from fp8blk.torch.linear import functional, sharing  # noqa: E402

from bench import bench_model  # noqa: E402


class Siblings(torch.nn.Module):
    """Three layers reading one input, as q/k/v do."""

    def __init__(self, k=256, n=(128, 64, 64)):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(k, w, bias=False) for w in n)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x), self.c(x)], -1)


@pytest.fixture
def quantize_calls(monkeypatch):
    """The shapes of the activations the layers quantized, in order."""
    calls = []
    real = functional.quantize_input

    def counted(x2d, recipe, need_columnwise):
        calls.append((tuple(x2d.shape), need_columnwise))
        return real(x2d, recipe, need_columnwise)
    monkeypatch.setattr(functional, "quantize_input", counted)
    return calls


def _siblings(share):
    torch.manual_seed(0)
    return convert_to_float8_block(Siblings(), share_quantize=share)


def _run(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    return [y, x.grad] + [p.grad for p in model.parameters()]


def test_siblings_share_one_quantization(quantize_calls):
    x = torch.randn(2, 130, 256)
    plain = _run(_siblings(False), x)
    assert len(quantize_calls) == 3
    quantize_calls.clear()
    with sharing.counting() as stats:
        shared = _run(_siblings(True), x)
    assert len(quantize_calls) == 1 and (stats.misses, stats.hits) == (1, 2)
    for a, b in zip(plain, shared):
        assert torch.equal(a, b)


def test_no_sharing_outside_a_scope(quantize_calls):
    model = Siblings()
    convert_to_float8_block(model, share_quantize=False)
    model(torch.randn(4, 256))
    assert len(quantize_calls) == 3


class InPlace(Siblings):
    def forward(self, x):
        a = self.a(x)
        x.mul_(2)                               # the input changes between its readers
        return torch.cat([a, self.b(x), self.c(x)], -1)


def test_in_place_update_of_the_input(quantize_calls):
    x = torch.randn(128, 256)
    torch.manual_seed(0)
    ref = convert_to_float8_block(InPlace(), share_quantize=False)
    torch.manual_seed(0)
    shared = convert_to_float8_block(InPlace(), share_quantize=True)
    with torch.no_grad():
        y_ref = ref(x.clone())
        quantize_calls.clear()
        y = shared(x.clone())
    assert len(quantize_calls) == 2             # before and after the update
    assert torch.equal(y, y_ref)


def test_no_grad_then_grad_are_different_keys(quantize_calls):
    """A pass without grad quantizes rowwise only; a pass with grad in the same scope makes
    its own both-direction copy (reentrant checkpointing does this)."""
    model = convert_to_float8_block(Siblings(), share_quantize=False)
    x = torch.randn(128, 256)
    with sharing.sharing():
        with torch.no_grad():
            y0 = model(x)
        y1 = model(x)
    assert [c[1] for c in quantize_calls] == [False, True]
    assert torch.equal(y0, y1)


def test_the_cache_does_not_keep_the_input_alive():
    model = convert_to_float8_block(Siblings(), share_quantize=True)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            h = x * 2                               # an activation nobody saves
            ref.append(weakref.ref(h))
            y = self.inner.a(h) + 0
            del h
            gc.collect()
            alive.append(ref[0]() is not None)
            return y

    ref, alive = [], []
    outer = Outer()
    sharing.install(outer)
    outer(torch.randn(128, 256, requires_grad=True)).sum().backward()
    assert alive == [False]


def test_activation_checkpointing(quantize_calls):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = _siblings(False)

        def forward(self, x):
            return checkpoint(self.s, x, use_reentrant=False)

    x = torch.randn(130, 256)
    plain = _run(_siblings(False), x)
    model = Checkpointed()
    sharing.install(model)
    quantize_calls.clear()
    out = _run(model, x)
    # forward: one shared quantization; the recomputation in backward runs outside the
    # forward's scope and quantizes per layer
    assert len(quantize_calls) == 1 + 3
    for a, b in zip(plain, out):
        assert torch.equal(a, b)


# -- a tiny Hugging Face Llama ------------------------------------------------------------

LAYERS = 2


def _llama(variant):
    pytest.importorskip("transformers")
    return bench_model.build_model("llama", variant, LAYERS, 64, "cpu", tiny=True)


def _train(model, ids, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    record = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        record.append([loss.detach().clone()]
                      + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    record.append([p.detach().clone() for p in model.parameters()])
    return record


@pytest.mark.timeout(120)
def test_tiny_llama_shares_with_the_same_bytes(quantize_calls):
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    # the same norm and MLP swaps both ways: sharing alone must not change a byte
    plain, shared = _llama("fp8blk_norm_mlp"), _llama("fp8blk_opt")
    assert sum(type(m).__name__ == "Float8BlockGatedMLP" for m in shared.modules()) == LAYERS
    quantize_calls.clear()                       # the swaps' probes quantized too
    ref = _train(plain, ids)
    per_step_plain = len(quantize_calls) // 3
    assert per_step_plain == 7 * LAYERS          # q, k, v, o, gate, up, down
    quantize_calls.clear()
    with sharing.counting() as stats:
        opt = _train(shared, ids)
    # one quantization per distinct activation: the attention norm's output (q, k, v), the
    # attention output (o), the MLP norm's output (gate, up), the SwiGLU product (down)
    assert len(quantize_calls) // 3 == 4 * LAYERS
    assert (stats.misses, stats.hits) == (3 * 4 * LAYERS, 3 * 3 * LAYERS)
    for step_ref, step_opt in zip(ref, opt):
        for a, b in zip(step_ref, step_opt):
            assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_tiny_llama_saves_fewer_bytes_than_bf16():
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    saved = {}
    for variant in ("bf16", "fp8blk", "fp8blk_opt"):
        model = _llama(variant)
        nbytes, loss = bench_model.saved_bytes(
            lambda: model(input_ids=ids, labels=ids).loss, exclude=list(model.parameters()))
        loss.backward()
        saved[variant] = nbytes
    assert saved["fp8blk_opt"] < saved["fp8blk"] <= 1.02 * saved["bf16"], saved
    assert saved["fp8blk_opt"] < 0.9 * saved["bf16"], saved


@pytest.mark.timeout(120)
def test_bench_model_runs_tiny_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "model.json"
    result = bench_model.main(["--device", "cpu", "--tiny", "--arch", "qwen3", "--variants",
                               "bf16,fp8blk_opt", "--steps", "1", "--warmup", "1",
                               "--out", str(out)])
    cases = {c["variant"]: c for c in result["cases"]}
    assert set(cases) == {"bf16", "fp8blk_opt"} and out.exists()
    assert cases["fp8blk_opt"]["saved_bytes_vs_bf16"] < 0.9
    assert all(c["step_ms"] > 0 and c["tokens"] == 256 for c in cases.values())


# -- torch.compile: the graph's CSE shares ------------------------------------------------

def test_compiled_siblings_quantize_once_in_the_traced_graph():
    """On the plan path (CUDA, traced here with fake CUDA tensors) each layer's x quantize is
    an op of its own with x and the recipe as its only inputs: three siblings' nodes are
    merged by the CSE pass inductor's partitioner runs, and the GEMMs read the one node."""
    from torch._functorch.compile_utils import fx_graph_cse
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8blk.torch import Float8BlockConfig
    from fp8blk.torch.linear import compiled

    cfg = Float8BlockConfig()
    with FakeTensorMode():
        x = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
        ws = [torch.empty(n, 256, device="cuda", dtype=torch.bfloat16) for n in (256, 128, 128)]

        def three(x, *ws):
            outs = [compiled.forward(x, w, cfg, torch.bfloat16, True, True) for w in ws]
            return [y for y, _ in outs] + [t for _, xt in outs for t in xt]
        gm = make_fx(three)(x, *ws)

    def ops(graph):
        return [str(n.target).split(".")[1] for n in graph.nodes
                if n.op == "call_function" and str(n.target).startswith("fp8blk.")]
    assert ops(gm.graph) == ["linear_quantize_x", "linear_fwd_mm"] * 3
    assert ops(fx_graph_cse(gm.graph)) == ["linear_quantize_x"] + ["linear_fwd_mm"] * 3


@pytest.mark.timeout(300)
def test_tiny_llama_compiled_keeps_what_eager_keeps():
    """Each decoder layer compiled (min-cut partitioner, as inductor: the CPU's aot_eager
    backend with it): the eager bytes over 2 steps, and no more saved bytes than eager with
    sharing, the norm and the MLP swaps (bench_model's fp8blk_nokeep: on the CPU a compiled
    layer keeps its FP8 copy even where it would keep its input, fp8blk/torch/linear/
    functional.py; test_compiled.py has the plan ops' graphs)."""
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    runs = {}
    try:
        for mode in ("eager", "compiled"):
            model = _llama("fp8blk_nokeep")
            if mode == "compiled":
                for layer in model.model.layers:
                    layer.compile(backend="aot_eager_decomp_partition")
            record = _train(model, ids, steps=2)
            nbytes, loss = bench_model.saved_bytes(
                lambda: model(input_ids=ids, labels=ids).loss, exclude=list(model.parameters()))
            loss.backward()
            runs[mode] = record, nbytes
    finally:
        torch._dynamo.reset()
    for step_e, step_c in zip(runs["eager"][0], runs["compiled"][0]):
        for a, b in zip(step_e, step_c):
            assert torch.equal(a, b)
    # the hooks see the compiled graphs' saved tensors (not nothing)
    assert 0.5 * runs["eager"][1] < runs["compiled"][1] <= runs["eager"][1], (
        runs["compiled"][1], runs["eager"][1])
