"""fp8blk/torch/linear/hot.py: a layer's memo of its last plan-served call. On the CPU: which
calls the memo serves and which it hands back (every change that would make the plan wrong),
and that copies of a layer do not carry it. On the GPU: the memo's steps give the general
path's bytes (output, input, weight and bias gradients) on every shape class the plan tests
cover, with a sharing scope, keep_input, autocast and under no_grad, and a memo whose weight
was swapped under it (same object, same address, other rows) is not used."""
import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

from fp8blk.torch import Float8BlockConfig, Float8BlockLinear  # noqa: E402
from fp8blk.torch.linear import hot as hot_module  # noqa: E402
from fp8blk.torch.linear import module as linear_module  # noqa: E402
from fp8blk.torch.linear import plans as linear_plans  # noqa: E402
from fp8blk.torch.linear import sharing  # noqa: E402

from .._parity import assert_same, init_spread_, spread  # noqa: E402
from .test_plans import _step  # noqa: E402  (a step's output and gradients)


class _Lean:
    """A stand-in for the plan's lean path: records the calls, returns fixed tensors."""

    def __init__(self, y_shape, n, k):
        self.calls = []
        self.y = torch.zeros(y_shape, dtype=torch.bfloat16)
        self.xt = (torch.zeros(k, 4, dtype=torch.uint8), torch.zeros(1, 4))
        self.dw = torch.zeros(n, k, dtype=torch.bfloat16)

    def forward(self, x, weight, share, y_spec):
        self.calls.append("forward")
        return self.y, self.xt

    def backward(self, dy, xt_d, xt_s, weight, need_dgrad, need_wgrad, x, dx_spec):
        self.calls.append("backward")
        return torch.zeros(dx_spec[0], dtype=torch.bfloat16) if need_dgrad else None, \
            self.dw if need_wgrad else None


def _cpu_hot(layer, x):
    """A Hot for a CPU call, as ``memo`` makes one for a CUDA call (device index -1)."""
    n, k = layer.weight.shape
    h = hot_module.Hot()
    w = layer.weight
    h.weight, h.w_shape, h.w_dtype, h.w_grad = w, w.shape, w.dtype, w.requires_grad
    h.x_shape, h.x_dtype, h.x_grad, h.index = x.shape, x.dtype, x.requires_grad, -1
    h.grad, h.autocast, h.out_dtype = True, False, x.dtype
    h.cfg, h.keep_input, h.keep, h.cols, h.n = layer.config, layer.keep_input, False, True, n
    h.y_spec = (x.shape[:-1] + (n,), None, x.dtype)
    h.dx_spec = (tuple(x.shape), None, x.dtype)
    h.x2d_shape = (x.numel() // k, k)
    h.lean = h.plan = _Lean(h.y_spec[0], n, k)
    return h


def _layer():
    torch.manual_seed(0)
    return Float8BlockLinear(256, 128, bias=True, dtype=torch.bfloat16)


def _x(layer, shape=(2, 8, 256)):
    return torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)


def test_a_matching_call_runs_the_memo():
    layer = _layer()
    x = _x(layer)
    h = _cpu_hot(layer, x)
    y = h(x, layer.weight, layer.bias, layer.config, layer.keep_input)
    assert y is not None and y.shape == (2, 8, 128)
    y.backward(torch.ones_like(y))
    assert h.lean.calls == ["forward", "backward"]
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (128, 256)
    # the bias gradient: the sum of dY's rows, as the general path sums it
    assert torch.equal(layer.bias.grad, torch.ones(16, 128, dtype=torch.bfloat16).sum(0))


class _Plan:
    """A stand-in for a plan without a lean path (``low_memory_forward``, GEMMs on
    torch._scaled_mm): its 2-D calls, recorded."""

    def __init__(self, n, k):
        self.calls = []
        self.n, self.k = n, k

    def forward(self, x2d, weight, share=None):
        self.calls.append(("forward", tuple(x2d.shape)))
        return (torch.zeros(x2d.shape[0], self.n, dtype=torch.bfloat16),
                (torch.zeros(self.k, 4, dtype=torch.uint8), torch.zeros(1, 4)))

    def backward(self, dy2d, xt_d, xt_s, weight, need_dgrad, need_wgrad, x2d=None):
        self.calls.append(("backward", tuple(dy2d.shape)))
        return (torch.zeros(dy2d.shape[0], self.k, dtype=torch.bfloat16),
                torch.zeros(self.n, self.k, dtype=torch.bfloat16))


def test_a_plan_without_a_lean_path_runs_on_2d_views():
    """A memo whose plan has no lean path runs the plan's own calls on 2-D views of x and
    dY and gives y and dx in the caller's shapes."""
    layer = _layer()
    x = _x(layer)
    h = _cpu_hot(layer, x)
    h.lean, h.plan = None, _Plan(128, 256)
    y = h(x, layer.weight, layer.bias, layer.config, False)
    assert y.shape == (2, 8, 128)
    y.backward(torch.ones_like(y))
    assert h.plan.calls == [("forward", (16, 256)), ("backward", (16, 128))]
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (128, 256)


def _changes():
    """(name, change(layer, x) -> (x, weight, config, keep_input)): each must miss."""
    def x_only(f):
        return lambda layer, x: (f(x), layer.weight, layer.config, layer.keep_input)

    def with_weight(f):
        return lambda layer, x: (x, f(layer), layer.config, layer.keep_input)

    def same_storage_rows(layer):           # same object and address, fewer rows (pruning)
        layer.weight.data = layer.weight.data[:64]
        return layer.weight

    class Sub(torch.Tensor):
        pass
    return [
        ("x shape", x_only(lambda x: x.detach().reshape(16, 256).requires_grad_())),
        ("x dtype", x_only(lambda x: x.detach().float().requires_grad_())),
        ("x without grad", x_only(lambda x: x.detach())),
        ("x not contiguous", x_only(
            lambda x: x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_())),
        ("x unaligned", x_only(lambda x: torch.empty(4097, dtype=torch.bfloat16)[1:]
                               .view(2, 8, 256).requires_grad_())),
        ("x a subclass", x_only(lambda x: x.detach().as_subclass(Sub).requires_grad_())),
        ("other weight object", with_weight(
            lambda layer: torch.nn.Parameter(layer.weight.detach().clone()))),
        ("weight dtype (.data swapped)", with_weight(
            lambda layer: setattr(layer.weight, "data", layer.weight.data.float())
            or layer.weight)),
        ("weight rows (.data view, same address)", with_weight(same_storage_rows)),
        ("weight frozen", with_weight(lambda layer: layer.weight.requires_grad_(False))),
        ("config", lambda layer, x: (x, layer.weight, Float8BlockConfig(), layer.keep_input)),
        ("keep_input", lambda layer, x: (x, layer.weight, layer.config, True)),
    ]


@pytest.mark.parametrize("name,change", _changes(), ids=[c[0] for c in _changes()])
def test_a_changed_call_misses(name, change):
    layer = _layer()
    x = _x(layer)
    h = _cpu_hot(layer, x)
    x2, w2, cfg2, keep2 = change(layer, x)
    assert h(x2, w2, layer.bias, cfg2, keep2) is None, name
    assert h.lean.calls == []


def test_a_transposed_square_weight_at_the_same_address_misses():
    torch.manual_seed(0)
    layer = Float8BlockLinear(256, 256, bias=False, dtype=torch.bfloat16)
    x = _x(layer)
    h = _cpu_hot(layer, x)
    layer.weight.data = layer.weight.data.t()          # same address and shape
    assert h(x, layer.weight, None, layer.config, False) is None


@pytest.mark.parametrize("mode", ["no_grad", "autocast"])
def test_grad_mode_and_autocast_changes_miss(mode):
    layer = _layer()
    x = _x(layer)
    h = _cpu_hot(layer, x)
    if mode == "no_grad":
        with torch.no_grad():
            assert h(x, layer.weight, layer.bias, layer.config, False) is None
        return
    # CUDA autocast's state set directly: the memo reads it for CUDA calls (no GPU here)
    dtype = torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.float16)
        assert h(x, layer.weight, layer.bias, layer.config, False) is None
        h.autocast, h.out_dtype = True, torch.bfloat16     # a memo made under bf16 autocast
        assert h(x, layer.weight, layer.bias, layer.config, False) is None
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        assert h(x, layer.weight, layer.bias, layer.config, False) is not None
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", dtype)
    assert h(x, layer.weight, layer.bias, layer.config, False) is None   # autocast off


def test_create_graph_keeps_the_layer_first_order():
    layer = _layer()
    x = _x(layer)
    h = _cpu_hot(layer, x)
    y = h(x, layer.weight, layer.bias, layer.config, False)
    # a gradient penalty: dY depends on x, so the gradient of the gradient reaches the layer
    (gx,) = torch.autograd.grad((y.float() ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.float().sum().backward()


def test_no_memo_on_the_cpu_and_copies_drop_it():
    layer = _layer()
    x = _x(layer)
    layer(x)
    assert layer._hot is None             # CPU calls take the general path
    layer._hot = _cpu_hot(layer, x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone._hot is None and isinstance(clone, Float8BlockLinear)
    assert layer._hot is not None


# ---- GPU: the memo's bytes ----------------------------------------------------------------

def _general(m):
    """Steps on the general path: no memo, no plan."""
    m.setattr(hot_module.Hot, "__call__", lambda self, *a: None)
    m.setattr(linear_plans, "plan_for", lambda *a: None)


CASES = [
    dict(shape=(512, 1024), n=1536, dtype=torch.bfloat16, bias=True),
    dict(shape=(2, 512, 512), n=1024, dtype=torch.bfloat16, bias=False),
    dict(shape=(4, 2, 128, 256), n=384, dtype=torch.bfloat16, bias=True),
    dict(shape=(1024, 512), n=512, dtype=torch.float32, bias=True),
    dict(shape=(512, 512), n=512, dtype=torch.float16, bias=False),
    dict(shape=(512, 512), n=1024, dtype=torch.bfloat16, bias=True, x_grad=False),
    dict(shape=(512, 512), n=1024, dtype=torch.bfloat16, bias=True, w_grad=False),
    dict(shape=(1008, 640), n=384, dtype=torch.bfloat16, bias=True),
    dict(shape=(2, 200, 384), n=896, dtype=torch.bfloat16, bias=False, keep=True),
    dict(shape=(1024, 1024), n=1024, dtype=torch.float32, bias=True, autocast=torch.bfloat16),
    dict(shape=(2, 256, 512), n=512, dtype=torch.bfloat16, bias=True, share=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_memo_steps_equal_the_general_path(case, rng, monkeypatch):
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    shape, n, dtype = case["shape"], case["n"], case["dtype"]
    layer = Float8BlockLinear(shape[-1], n, bias=case["bias"], device="cuda", dtype=dtype)
    init_spread_(layer, gen)
    layer.weight.requires_grad_(case.get("w_grad", True))
    layer.keep_input = case.get("keep", False)
    served = []
    real = hot_module._HotFn.apply
    monkeypatch.setattr(hot_module._HotFn, "apply",
                        lambda *a: served.append(1) or real(*a))
    for i in range(3):                  # fresh data each step; the memo made on step 0
        x = spread(shape, gen, dtype).cuda().requires_grad_(case.get("x_grad", True))
        g = spread(shape[:-1] + (n,), gen, dtype).cuda()

        def run():
            ctx = (torch.autocast("cuda", case["autocast"]) if "autocast" in case
                   else torch.enable_grad())
            with ctx, (sharing.sharing() if case.get("share") else torch.enable_grad()):
                return _step(layer, x, g)
        got = run()
        assert len(served) == i + 1, "the step did not take the memo"
        with monkeypatch.context() as m:
            _general(m)
            want = run()
        assert len(served) == i + 1
        assert_same(got, want, (case, i))
    with torch.no_grad():
        want = layer(x)
        with monkeypatch.context() as m:
            _general(m)
            assert torch.equal(layer(x), want)


@pytest.mark.gpu
def test_a_memo_whose_weight_changed_under_it_is_not_used(rng, monkeypatch):
    """The weight's storage swapped for a view of its first rows (same object, same address:
    pruning by slicing): the memo made for the old rows misses, and the step is the general
    path's on the new weight."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    layer = Float8BlockLinear(512, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    init_spread_(layer, gen)
    x = spread((256, 512), gen).cuda().bfloat16().requires_grad_()
    _step(layer, x, spread((256, 1024), gen).cuda().bfloat16())
    old = layer._hot
    assert old is not None
    ptr = layer.weight.data_ptr()
    layer.weight.data = layer.weight.data[:512]
    assert layer.weight.data_ptr() == ptr
    g = spread((256, 512), gen).cuda().bfloat16()
    got = _step(layer, x, g)
    assert layer._hot is not old and got[0].shape == (256, 512)
    with monkeypatch.context() as m:
        _general(m)
        want = _step(layer, x, g)
    assert_same(got, want, "swapped rows")


@pytest.mark.gpu
def test_memo_on_a_side_stream_takes_the_allocating_path(rng, monkeypatch):
    """On a stream other than the default one the memo's call runs the plan's allocating
    path (as under capture): the same bytes, no scratch memory made there."""
    from fp8blk.torch import _arena
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    layer = Float8BlockLinear(1024, 1536, device="cuda", dtype=torch.bfloat16)
    init_spread_(layer, gen)
    x = spread((2, 512, 1024), gen, torch.bfloat16).cuda().requires_grad_()
    g = spread((2, 512, 1536), gen, torch.bfloat16).cuda()
    want = _step(layer, x, g)
    _step(layer, x, g)
    assert layer._hot is not None
    held = _arena.held()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _step(layer, x, g)
    torch.cuda.current_stream().wait_stream(side)
    assert_same(got, want, "side stream")
    assert _arena.held() == held
    assert linear_module._memo is hot_module.memo
