"""Shared test configuration.

GPU tests are marked ``gpu`` and skipped where no CUDA device and CuPy are present; the
simulator tests set NUMBA_ENABLE_CUDASIM themselves in a subprocess or before numba loads.
"""
import os

import numpy as np
import pytest


def _have_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAVE_GPU = _have_gpu()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (run on the H200 with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Simulator tests go last and their jobs start now in the background (tests/sim_jobs.py:
    ~6.5 min of one core, overlapping the rest of the suite on a second core). An xdist
    worker leaves its jobs to start when its tests ask for them."""
    from tests import sim_jobs

    items = session.items
    sim = [it for it in items if sim_jobs.job_of(it.nodeid)]
    if not sim:
        return
    items[:] = [it for it in items if not sim_jobs.job_of(it.nodeid)] + sim
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        sim_jobs.JOBS.start(sim_jobs.to_start([it.nodeid for it in sim
                                               if not it.get_closest_marker("skip")]))


def pytest_sessionfinish(session):
    from tests import sim_jobs

    sim_jobs.stop()


@pytest.fixture
def rng(request):
    """A fresh, reported seed per test: failures print the seed, reruns draw new data."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
