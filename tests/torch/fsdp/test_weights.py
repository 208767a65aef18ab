"""Single-process checks of the FSDP2 weight subclasses (fp8blk/torch/fsdp/weights.py): the ops FSDP2
applies when sharding and padding map onto the FP8 planes byte for byte, the post-all-gather
hook builds the gathered BlockTensor (columnwise by FP8 transpose) equal to fb.quantize, and
unsupported uses fail clearly. The distributed checks are in test_fsdp.py."""
import copy
import inspect
import math

import pytest

torch = pytest.importorskip("torch")

import fp8blk as fb  # noqa: E402
from fp8blk.torch import fsdp as F  # noqa: E402
from fp8blk.torch.fsdp import weights as W  # noqa: E402


def _spread(rng, rows, cols):
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 3, (rows, 1)) \
        * 10.0 ** rng.uniform(-2, 2, (1, cols))
    return torch.from_numpy(x.astype("float32"))


def _model(w, recipe=None):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = torch.nn.Sequential(lin)
    return model, (lambda m, n: isinstance(m, torch.nn.Linear)), recipe


@pytest.mark.parametrize("recipe", [fb.Block2D(), fb.MXFP8()], ids=["block2d", "mxfp8"])
def test_primary_planes_follow_fsdp_chunk_pad_copy(rng, recipe):
    rows, cols = 288, 160 if isinstance(recipe, fb.Block2D) else 192
    w = _spread(rng, rows, cols)
    model, filt, r = _model(w, recipe)
    F.prepare_fsdp_fp8(model, mode="primary", module_filter_fn=filt, recipe=r)
    p = model[0].weight
    assert isinstance(p, W.Float8BlockPrimaryWeight) and p.dtype == torch.float32
    q = fb.quantize(w.to(torch.bfloat16), recipe, rowwise=True,
                    columnwise=isinstance(recipe, fb.MXFP8))
    full = [q.rowwise_data] + ([q.columnwise_data] if isinstance(recipe, fb.MXFP8) else [])
    ws = 4
    chunk = math.ceil(rows / ws)
    chunks = torch.chunk(p, ws, dim=0)          # what FSDP2 does (split), then pads rank 3
    for i, c in enumerate(chunks):
        assert isinstance(c, W.Float8BlockPrimaryWeight)
        for plane, ref in zip(c._planes, full):
            assert torch.equal(plane, ref[i * chunk:(i + 1) * chunk])
    padded = chunks[-1].new_zeros((chunk + 5, cols))
    padded.narrow(0, 0, chunks[-1].shape[0]).copy_(chunks[-1])
    local = padded.narrow(0, 0, chunks[-1].shape[0])
    for plane, ref in zip(local._planes, full):
        assert plane.dtype == torch.uint8 and torch.equal(plane, ref[(ws - 1) * chunk:])
    assert padded.view(-1).shape == ((chunk + 5) * cols,)
    with pytest.raises(NotImplementedError, match="master"), torch.no_grad():
        p.add_(1.0)
    with pytest.raises(NotImplementedError, match="cast_master_weights_"):
        local.copy_(torch.zeros(local.shape))
    # reads see the dequantized values, as plain tensors (of the whole shard only: a part's
    # rows would need their place among the weight's tiles)
    doubled = p * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, q.dequantize(torch.float32) * 2)
    with pytest.raises(RuntimeError, match="whole shard"):
        chunks[1] * 2


def test_cast_weight_updates_in_place_and_preserves_subclass(rng):
    w = _spread(rng, 200, 128)
    model, filt, _ = _model(w)
    F.prepare_fsdp_fp8(model, mode="cast", module_filter_fn=filt)
    p = model[0].weight
    assert isinstance(p, W.Float8BlockCastWeight) and torch.equal(p.hp, w)
    with torch.no_grad():
        p.add_(torch.ones_like(w), alpha=-0.5)  # an optimizer's update
    assert torch.equal(p.hp, w - 0.5)
    assert isinstance(torch.zeros_like(p), W.Float8BlockCastWeight)
    doubled = p * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, (w - 0.5) * 2)


def test_cast_weight_foreach_update_in_place(rng):
    # foreach optimizers (the CUDA default) pass lists of weights to one op
    w = _spread(rng, 128, 128)
    model, filt, _ = _model(w)
    F.prepare_fsdp_fp8(model, mode="cast", module_filter_fn=filt)
    p = model[0].weight
    with torch.no_grad():
        torch._foreach_add_([p], [torch.ones_like(w)], alpha=-0.25)
        torch._foreach_mul_([p], 2.0)
    assert isinstance(p, W.Float8BlockCastWeight) and torch.equal(p.hp, (w - 0.25) * 2)


def test_pre_all_gather_hook_signature_and_copies(rng):
    # FSDP2 reads the hook's signature before every all-gather; the first gather leaves a
    # hook object on the tensor whose signature is stored (no self), which copies drop
    w = _spread(rng, 128, 128)
    model, filt, _ = _model(w)
    F.prepare_fsdp_fp8(model, mode="cast", module_filter_fn=filt)
    p = model[0].weight
    names = ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]
    assert list(inspect.signature(p.fsdp_pre_all_gather).parameters) == names
    p.fsdp_pre_all_gather = W._PreAllGatherHook(p)  # what the first gather does
    assert list(inspect.signature(p.fsdp_pre_all_gather).parameters) == names
    q = copy.deepcopy(p)
    assert "fsdp_pre_all_gather" not in q.__dict__ and torch.equal(q.hp, p.hp)
    assert q.fsdp_pre_all_gather.__self__ is q


@pytest.mark.parametrize("usage", [(True, False), (False, True), (True, True)])
def test_post_all_gather_builds_quantize_equal_weight(rng, usage):
    # the post hook on the "gathered" rowwise bytes (one rank holding everything)
    rows, cols = 300, 200
    w = _spread(rng, rows, cols)
    model, filt, _ = _model(w)
    F.prepare_fsdp_fp8(model, mode="primary", module_filter_fn=filt)
    local = model[0].weight
    state = local._state
    out, inner = local.fsdp_post_all_gather((local._planes[0].clone(),),
                                            (state, ("row",), usage), torch.bfloat16)
    assert isinstance(out, W.Float8BlockWeight) and out.dtype == torch.bfloat16
    want = fb.quantize(w.to(torch.bfloat16), fb.Block2D(), rowwise=True, columnwise=True)
    q = out.fp8blk_block_tensor(*usage)
    assert q.has_rowwise == usage[0] and q.has_columnwise == usage[1]
    if usage[0]:
        assert torch.equal(q.rowwise_data, want.rowwise_data)
        assert torch.equal(q.rowwise_scale_inv, want.rowwise_scale_inv)
    if usage[1]:
        assert torch.equal(q.columnwise_data, want.columnwise_data)
        assert torch.equal(q.columnwise_scale_inv, want.columnwise_scale_inv)
        assert inner[0].untyped_storage().data_ptr() == q.columnwise_data.data_ptr()
    else:
        assert inner[0].untyped_storage().nbytes() == 0  # not made, memory released
    # aliases FSDP makes share the gathered storage; other ops see the dequantized weight
    alias = torch.as_strided(out, out.shape, out.stride(), 0).detach()
    assert isinstance(alias, W.Float8BlockWeight) and alias._box is out._box
    if usage[0]:
        assert torch.equal(out + 0, want.dequantize(torch.bfloat16))
    # a re-gather with out= updates in place without bumping the version counter
    v = out._version
    assert local.fsdp_post_all_gather((local._planes[0].clone(),), (state, ("row",), usage),
                                      torch.bfloat16, out=out) is None
    assert out._version == v and out.fp8blk_block_tensor(*usage).has_columnwise == usage[1]


def test_conversion_errors():
    with pytest.raises(ValueError, match="mode must be"):
        F.prepare_fsdp_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)), mode="fp8")
    with pytest.raises(TypeError, match="model_dtype"):
        F.prepare_fsdp_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)),
                           model_dtype=torch.float64)
    lin = torch.nn.Linear(64, 64).half()
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        F.prepare_fsdp_fp8(torch.nn.Sequential(lin),
                           module_filter_fn=lambda m, n: isinstance(m, torch.nn.Linear))
