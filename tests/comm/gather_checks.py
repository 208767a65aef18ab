"""What the gather tests share: the four buffer names of a BlockTensor, an input with rows of
very different magnitudes, and the byte-for-byte comparison of two BlockTensors."""
import numpy as np

NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def gather_input(rng, rows, k):
    """(rows, k) float32 whose rows span eight decades (per-block scales differ)."""
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-4, 4, (rows, 1))
    return x.astype(np.float32)


def assert_same_bytes(got, expected, host=np.asarray, label=()):
    """Every buffer of BlockTensor ``got`` has the shape and bytes of ``expected``'s (None
    where it is None); ``host(buf)`` makes a buffer a NumPy array (device buffers copied)."""
    for name in NAMES:
        g, e = getattr(got, name), getattr(expected, name)
        assert (g is None) == (e is None), (*label, name)
        if e is not None:
            g, e = host(g), host(e)
            assert g.shape == e.shape, (*label, name, g.shape, e.shape)
            assert np.array_equal(g.view(np.uint8), e.view(np.uint8)), (*label, name)
