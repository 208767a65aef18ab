"""Single process: bad input gets a clear error naming the argument and what was
expected, never a late AttributeError, a NumPy message or a silently wrong answer. (The
multi-rank cases are in tests/test_bad_input_mpi.py, the command line's in tests/cli.)"""
import numpy as np
import pytest

import fp8blk as fb
from fp8blk.master import cast_master_weights
from fp8blk.tensor import from_internal, internal_buffers
from tests.master.scripts import cases
from tests.master.scripts.fake_comm import run_ranks


def _x(rng, shape=(64, 256)):
    """Rows spanning orders of magnitude, so every block gets its own scale."""
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, (shape[0], 1)))
            ).astype(np.float32)


# --------------------------------------------------------------------------------------------
# BlockTensor constructor


def test_constructor_accepts_what_quantize_makes(rng):
    x = _x(rng)
    for recipe in (fb.Block1D(), fb.Block2D(), fb.MXFP8()):
        q = fb.quantize(x, recipe, rowwise=True, columnwise=True)
        bufs = [q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv]
        q2 = fb.BlockTensor(x.shape, recipe, *bufs)
        np.testing.assert_array_equal(q2.dequantize(), q.dequantize())
        col = fb.BlockTensor(list(x.shape), recipe, None, None, *bufs[2:])
        np.testing.assert_array_equal(col.dequantize(), q.update_usage(rowwise=False)
                                      .dequantize())


@pytest.mark.parametrize("recipe", [None, "Block1D", fb.E4M3, fb.Block1D])
def test_constructor_rejects_a_bad_recipe(recipe):
    with pytest.raises(TypeError, match="recipe must be fp8blk.Block1D"):
        fb.BlockTensor((4, 128), recipe)


@pytest.mark.parametrize("shape, kind, match", [
    ((-1, 128), ValueError, r"dims >= 0"),
    ((4, -128), ValueError, r"dims >= 0"),
    ((), ValueError, r"at least one dim"),
    ("4x128", TypeError, r"tuple of ints"),
    (4, TypeError, r"tuple of ints"),
    ((4.0, 128), TypeError, r"tuple of ints"),
    ((True, 128), TypeError, r"tuple of ints"),
])
def test_constructor_rejects_a_bad_shape(shape, kind, match):
    with pytest.raises(kind, match=match):
        fb.BlockTensor(shape, fb.Block1D())


def test_constructor_checks_buffers_against_the_layout(rng):
    q = fb.quantize(_x(rng), fb.Block1D(), rowwise=True, columnwise=True)
    data, sinv = q.rowwise_data, q.rowwise_scale_inv
    with pytest.raises(ValueError, match=r"rowwise_data must be uint8\(64, 256\).*float32"):
        fb.BlockTensor((64, 256), fb.Block1D(), data.astype(np.float32), sinv)
    with pytest.raises(ValueError, match=r"rowwise_scale_inv must be float32\(2, 64\)"):
        fb.BlockTensor((64, 256), fb.Block1D(), data, sinv[:, :60])
    with pytest.raises(ValueError, match=r"rowwise_data must be uint8\(64, 128\)"):
        fb.BlockTensor((64, 128), fb.Block1D(), data, sinv)  # buffers of another shape
    with pytest.raises(ValueError, match="given together"):
        fb.BlockTensor((64, 256), fb.Block1D(), data, None)
    with pytest.raises(ValueError, match="columnwise_data must be C-contiguous"):
        fb.BlockTensor((64, 256), fb.Block1D(), None, None,
                       np.asfortranarray(q.columnwise_data), q.columnwise_scale_inv)
    with pytest.raises(ValueError, match="multiples of 32"):
        fb.BlockTensor((64, 48), fb.MXFP8())
    with pytest.raises(TypeError, match="dtype .* must be float32, bfloat16 or float16"):
        fb.BlockTensor((64, 256), fb.Block1D(), data, sinv, dtype=np.int8)
    with pytest.raises(ValueError, match="family must be"):
        fb.BlockTensor((64, 256), fb.Block1D(), data, sinv, family="jax")
    with pytest.raises(ValueError, match="does not match the buffers"):
        fb.BlockTensor((64, 256), fb.Block1D(), data, sinv, family="cupy")
    with pytest.raises(TypeError, match="rowwise_data: expected a numpy.ndarray"):
        fb.BlockTensor((64, 256), fb.Block1D(), data.tolist(), sinv)


def test_constructor_takes_torch_buffers(rng):
    torch = pytest.importorskip("torch")
    x = _x(rng)
    q = fb.quantize(torch.from_numpy(x), fb.Block2D())
    q2 = fb.BlockTensor(x.shape, fb.Block2D(), q.rowwise_data, q.rowwise_scale_inv)
    assert isinstance(q2.rowwise_data, torch.Tensor)
    torch.testing.assert_close(q2.dequantize(), q.dequantize(), rtol=0, atol=0)


def test_wrap_is_the_unchecked_internal_door(rng):
    q = fb.quantize(_x(rng), fb.Block1D())
    w = from_internal(q.shape, q.recipe, list(internal_buffers(q)), q.dtype, "numpy")
    np.testing.assert_array_equal(w.dequantize(), q.dequantize())


# --------------------------------------------------------------------------------------------
# On/off flags: bool or numpy.bool_ everywhere; anything else is a TypeError


@pytest.mark.parametrize("flag", ["False", "True", 0, 1, None, 1.0])
def test_quantize_flags_must_be_bools(flag, rng):
    x = _x(rng)
    with pytest.raises(TypeError, match=r"rowwise must be True or False"):
        fb.quantize(x, fb.Block1D(), rowwise=flag)
    with pytest.raises(TypeError, match=r"columnwise must be True or False"):
        fb.quantize(x, fb.Block1D(), columnwise=flag)


def test_numpy_bools_are_bools(rng):
    x = _x(rng)
    q = fb.quantize(x, fb.Block2D(), rowwise=np.True_, columnwise=np.False_)
    assert q.has_rowwise and not q.has_columnwise
    q.update_usage(columnwise=np.True_)
    assert q.has_columnwise
    q.update_usage(rowwise=np.False_)  # honoured, not silently ignored
    assert not q.has_rowwise and q.has_columnwise
    assert fb.Block2D(pow2_scales=np.False_).pow2_scales is False


@pytest.mark.parametrize("flag", [0, 1, "False", 0.0])
def test_update_usage_flags_must_be_bools(flag, rng):
    q = fb.quantize(_x(rng), fb.Block2D(), rowwise=True, columnwise=True)
    with pytest.raises(TypeError, match="rowwise must be True or False"):
        q.update_usage(rowwise=flag)
    with pytest.raises(TypeError, match="columnwise must be True or False"):
        q.update_usage(columnwise=flag)
    assert q.has_rowwise and q.has_columnwise  # nothing changed
    with pytest.raises(TypeError, match="pow2_scales must be True or False"):
        fb.Block1D(pow2_scales=flag)


# --------------------------------------------------------------------------------------------
# torch tensors that hold no plain dense data


def test_torch_meta_sparse_quantized_say_what_is_wrong():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="meta device"):
        fb.quantize(torch.empty(32, 64, device="meta"), fb.Block1D())
    for sparse in (torch.eye(64).to_sparse(), torch.eye(64, dtype=torch.bfloat16).to_sparse()):
        with pytest.raises(TypeError, match=r"sparse torch tensor.*to_dense\(\)"):
            fb.quantize(sparse, fb.Block1D())
    with pytest.warns(UserWarning), pytest.raises(TypeError, match=r"quantized torch tensor"):
        fb.quantize(torch.quantize_per_tensor(torch.ones(32, 64), 0.1, 0, torch.qint8),
                    fb.Block1D())
    with pytest.raises(TypeError, match=r"torch dtype torch.float8_e4m3fn"):
        fb.quantize(torch.zeros(32, 64, dtype=torch.float8_e4m3fn), fb.Block1D())


# --------------------------------------------------------------------------------------------
# dequantize dtypes, epsilon, documented special values


@pytest.mark.parametrize("dtype", ["nonsense", np.int32, "uint8", None, 3])
def test_dequantize_names_the_allowed_dtypes(dtype, rng):
    q = fb.quantize(_x(rng), fb.Block1D())
    with pytest.raises(TypeError, match="dequantize dtype must be float32, bfloat16 or float16"):
        q.dequantize(dtype)
    with pytest.raises(TypeError, match="dequantize dtype must be float32, bfloat16 or float16"):
        fb.dequantize(q, dtype)


@pytest.mark.parametrize("cls", [fb.Block1D, fb.Block2D])
def test_epsilon_must_be_finite_in_float32(cls):
    for bad in (1e39, 3.5e38, float("inf"), float("nan"), -1e-6):
        with pytest.raises(ValueError, match="finite in float32"):
            cls(amax_epsilon=bad)
    assert cls(amax_epsilon=3.4e38).amax_epsilon == 3.4e38  # finite in float32: accepted


def test_special_values_are_what_the_docstrings_say():
    x = np.full((32, 64), 3.0, np.float32)
    x[0, 5], x[0, 40] = np.inf, -np.inf
    mx = fb.quantize(x, fb.MXFP8()).dequantize()
    # MXFP8 (as TE 2.20.2): a block holding inf -> its finite values 0, each inf saturated to
    # +-max in a block of scale 2**127, so dequantized back to +-inf
    assert mx[0, 5] == np.inf and mx[0, 40] == -np.inf
    assert (mx[0, :32][np.arange(32) != 5] == 0).all()
    assert (mx[1] == 3.0).all()
    b1 = fb.quantize(x, fb.Block1D()).dequantize()  # Block1D/2D: inf saturates to +-max
    assert b1[0, 5] == 448.0 and b1[0, 40] == -448.0


# --------------------------------------------------------------------------------------------
# cast_master_weights, one process


def test_single_rank_shard_must_cover_the_weight(rng):
    spec = cases.Spec((64, 96), fb.Block2D())
    full = cases.make_full(rng, spec.shape)

    def body(rank, comm):
        w = cases.alloc_weight(spec, rng)
        cast_master_weights([w], [full.reshape(-1)[5:].copy()], [5], comm)
    with pytest.raises(ValueError, match=r"masters\[0\] covers \[5, 6144\).*all 6144"):
        run_ranks(1, body)


def test_comm_must_be_a_communicator():
    class NoRank:
        def all_reduce(self, buf, op="max"):
            pass
    with pytest.raises(TypeError, match="rank, size and all_reduce"):
        cast_master_weights([], [], [], NoRank())


@pytest.mark.gpu
def test_torch_cuda_sparse_and_meta_say_what_is_wrong():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    with pytest.raises(TypeError, match="sparse torch tensor"):
        fb.quantize(torch.eye(64, device="cuda").to_sparse(), fb.Block1D())
    with pytest.raises(TypeError, match="meta device"):
        fb.quantize(torch.empty(64, 64, device="meta"), fb.Block1D())
