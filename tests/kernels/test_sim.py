"""Kernels under the Numba CUDA simulator, byte for byte against the reference (CPU, no GPU).

The simulator must be enabled before numba is imported, so the cases run in one subprocess
(sim_runner.py, ~1.5 min on 2 cores) and each case is reported as its own test here.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import sim_cases  # noqa: E402

NAMES = sim_cases.names()


@pytest.fixture(scope="module")
def sim_results():
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sim_runner.py"), str(seed)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"seed={seed}\n{proc.stderr[-4000:]}"
    return seed, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_reference_under_simulator(sim_results, name):
    seed, results = sim_results
    assert name in results, f"case did not run (seed={seed})"
    assert results[name] is None, f"seed={seed}: {results[name]}"
