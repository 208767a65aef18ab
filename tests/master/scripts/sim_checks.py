"""Master-weight kernels under the Numba CUDA simulator, byte for byte against the reference.

Run in a fresh process (the simulator must be chosen before numba loads):
    NUMBA_ENABLE_CUDASIM=1 python -m tests.master.scripts.sim_checks amax|cast|fast [SEED]
Prints "OK <what>" when every check passes; raises otherwise. Shapes are tiny: a simulated
thread costs ~150 us and these kernels launch 128-256 threads per CUDA block.
"""
import os
import sys
import threading

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    raise SystemExit("set NUMBA_ENABLE_CUDASIM=1 before running this script")
sys.setswitchinterval(0.01)  # the simulator's busy manager thread stalls blocks at 5 ms (sim_runner)

import numpy as np  # noqa: E402

from fp8blk.kernels import _numba  # noqa: E402
from tests.master.scripts import kernel_checks  # noqa: E402


# Simulated launches swap module globals while they run: never run two at once (the fake-comm
# ranks are threads).
_lock = threading.Lock()
_sim_call = _numba._SimKernel.__call__


def _locked_call(self, *args, **kwargs):
    with _lock:
        return _sim_call(self, *args, **kwargs)


_numba._SimKernel.__call__ = _locked_call


if __name__ == "__main__":
    what = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(f"seed={seed}", flush=True)
    {"amax": kernel_checks.check_amax, "cast": kernel_checks.check_cast,
     "fast": kernel_checks.check_fast_paths}[what](
        np.random.default_rng(seed))
    print(f"OK {what}", flush=True)
