"""Byte equality of quantized buffers, the one helper every test module uses.

Buffers may be NumPy arrays, CuPy arrays or torch tensors (copied to the host first); equality
is of shape, item size and every byte, so a NaN equals itself and +0 differs from -0.

* ``BUFFERS``                              the four buffer names of a BlockTensor
* ``buffers(q)``                           q's four buffers in that order (None where absent)
* ``to_host(buf)``                         a NumPy array with buf's bytes (None stays None)
* ``same_bytes(got, want)``                None when equal, else a message naming the first bytes
* ``assert_same_buffers(got, want)``       sequences of buffers (None where absent), in order
* ``assert_same(got, want, label=None)``   two BlockTensors' four buffers
"""
import numpy as np

BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def buffers(q):
    """(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv) of q."""
    return tuple(getattr(q, name) for name in BUFFERS)


def to_host(buf):
    """buf's bytes as a NumPy array of the same shape and item size (None stays None)."""
    if buf is None or isinstance(buf, np.ndarray):
        return buf
    if hasattr(buf, "detach"):  # torch: through an integer view (NumPy has no bf16/fp8 dtypes)
        import torch

        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        t = buf.detach()
        if t.dtype.is_floating_point:
            t = t.view(ints[t.element_size()])
        return t.cpu().numpy()
    if hasattr(buf, "get") and hasattr(buf, "data") and hasattr(buf, "device"):  # CuPy
        return buf.get()
    return np.asarray(buf)


def same_bytes(got, want):
    """None if got and want are equal byte for byte (shape and item size too), else a message."""
    if got is None or want is None:
        return None if got is None and want is None else f"one is None: {got!r} vs {want!r}"
    got, want = to_host(got), to_host(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.dtype.itemsize != want.dtype.itemsize:
        return f"dtype {got.dtype} != {want.dtype}"
    g = np.ascontiguousarray(got).view(np.uint8).reshape(-1)
    w = np.ascontiguousarray(want).view(np.uint8).reshape(-1)
    bad = np.flatnonzero(g != w)
    if bad.size == 0:
        return None
    return f"{bad.size} bytes differ, first at byte {bad[:5]}: got {g[bad[:5]]} want {w[bad[:5]]}"


def assert_same_buffers(got, want, names=BUFFERS):
    """Each pair of got / want (sequences in the order of `names`) is equal byte for byte and
    has the same dtype; a None in want requires a None in got."""
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, f"{name}: expected None"
            continue
        assert g is not None, f"{name}: missing"
        g, w = to_host(g), to_host(w)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (name, g.shape, g.dtype, w.shape,
                                                          w.dtype)
        gb = np.ascontiguousarray(g).view(np.uint8)
        wb = np.ascontiguousarray(w).view(np.uint8)
        if not np.array_equal(gb, wb):
            bad = np.argwhere(g.view(np.uint8 if g.dtype == np.uint8 else np.uint32)
                              != w.view(np.uint8 if w.dtype == np.uint8 else np.uint32))
            i = tuple(bad[0])
            raise AssertionError(f"{name}: {len(bad)} entries differ, first at {i}: "
                                 f"got {g[i]!r}, want {w[i]!r}")


def assert_same(got, want, label=None):
    """got's four buffers equal want's byte for byte (shape and item size; None where want's is)."""
    for name in BUFFERS:
        err = same_bytes(getattr(got, name), getattr(want, name))
        assert err is None, (label, name, err)
