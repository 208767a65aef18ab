"""Whether kernels run under Numba's CUDA simulator, read from the environment the way Numba
reads it (``NUMBA_ENABLE_CUDASIM``, an integer, non-zero = on), without importing numba: the
launchers and the disk cache need it on the path that never imports numba. ``_numba`` checks
that Numba agrees."""
import os


def _read():
    value = os.environ.get("NUMBA_ENABLE_CUDASIM", "").strip()
    try:
        return int(value) != 0 if value else False
    except ValueError:  # Numba warns and uses its default (off)
        return False


SIM = _read()
