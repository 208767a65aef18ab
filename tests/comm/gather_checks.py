"""What the gather tests share: the four buffer names of a BlockTensor, an input with rows of
very different magnitudes, and the byte-for-byte comparison of two BlockTensors."""
import numpy as np

from tests._same import BUFFERS as NAMES, same_bytes


def gather_input(rng, rows, k):
    """(rows, k) float32 whose rows span eight decades (per-block scales differ)."""
    x = rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-4, 4, (rows, 1))
    return x.astype(np.float32)


def assert_same_bytes(got, expected, host=None, label=()):
    """Every buffer of BlockTensor ``got`` has the shape and bytes of ``expected``'s (None
    where it is None); ``host(buf)``, if given, makes a buffer a NumPy array first (otherwise
    ``tests._same.to_host`` copies device buffers)."""
    for name in NAMES:
        g, e = getattr(got, name), getattr(expected, name)
        if host is not None:
            g, e = (None if g is None else host(g)), (None if e is None else host(e))
        problem = same_bytes(g, e)
        assert problem is None, (*label, name, problem)
