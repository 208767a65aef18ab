"""Kernels under the Numba CUDA simulator, byte for byte against the reference (CPU, no GPU).

The simulator must be enabled before numba is imported, so the cases run in one subprocess
(sim_runner.py, started in the background when collection ends: tests/sim_jobs.py) and each
case is reported as its own test here.
"""
import json

import pytest

from tests import sim_jobs
from tests.kernels import sim_cases

NAMES = sim_cases.names()


@pytest.fixture(scope="module")
def sim_results():
    # the subprocess runs in the background from the end of collection (tests/sim_jobs.py)
    code, out, err, seed = sim_jobs.result("kernels")
    assert code == 0, f"seed={seed}\n{err[-4000:]}"
    return seed, json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_reference_under_simulator(sim_results, name):
    seed, results = sim_results
    assert name in results, f"case did not run (seed={seed})"
    assert results[name] is None, f"seed={seed}: {results[name]}"
