"""The simulator jobs of the suite, and the PTX job of its compile tests, run in the background
while the other tests run.

The Numba CUDA simulator runs every simulated thread as a Python thread: the kernels' byte
checks under it take about 6.5 minutes of one core (sim_runner: all quantize / dequantize /
transpose cases; sim_checks: the master kernels' amax, cast and fast-path checks), and each
must run in a fresh process with NUMBA_ENABLE_CUDASIM=1. The compile tests' PTX (about 70
kernel variants for sm_90, tests/kernels/_ptx.py) is made in one more job, on the real Numba
target. ``conftest.py`` starts the jobs the
session selected in one background thread as soon as collection ends (one subprocess at a
time, the longest first) and moves their tests to the end of the session, so on CI's two
cores they overlap with the rest of the suite. A test asks for its job's result with
:func:`result`, which starts the job itself if nothing did (a single test run from the
command line, or a pytest-xdist worker).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPTS = {"kernels": ("-m", "tests.kernels.sim_runner"),
            "amax": ("-m", "tests.master.scripts.sim_checks", "amax"),
            "cast": ("-m", "tests.master.scripts.sim_checks", "cast"),
            "fast": ("-m", "tests.master.scripts.sim_checks", "fast"),
            "ptx": ("-m", "tests.kernels._ptx")}
_SIMULATED = {"kernels", "amax", "cast", "fast"}   # run with NUMBA_ENABLE_CUDASIM=1
# seconds of one core each on a CI machine: the order the background runs them
_COST = {"fast": 149, "kernels": 220, "cast": 72, "amax": 20, "ptx": 90}
# the compile tests whose PTX the "ptx" job makes (tests/kernels/_ptx.py)
_PTX_TESTS = ("tests/kernels/test_quantize_compile.py::test_quantize_kernel_compiles_for_sm90",
              "tests/kernels/test_quantize_compile.py::"
              "test_quantize_group_kernel_compiles_for_sm90",
              "tests/kernels/test_dequantize_compile.py::"
              "test_dequantize_kernel_compiles_for_sm90",
              "tests/kernels/test_partial.py::test_amax_kernel_compiles_for_sm90",
              "tests/kernels/test_partial.py::test_cast_kernel_compiles_for_sm90",
              "tests/kernels/test_partial.py::test_scale_kernel_compiles_for_sm90")
TIMEOUT = 600  # per job, from its own start


def job_of(nodeid: str):
    """The simulator job a test needs, by its node id (None for other tests)."""
    if nodeid.startswith("tests/kernels/test_sim.py::"):
        return "kernels"
    if nodeid.startswith(_PTX_TESTS):
        return "ptx"
    for name, test in (("amax", "test_partial_amax_matches_reference_in_simulator"),
                       ("cast", "test_device_path_matches_quantize_in_simulator"),
                       ("fast", "test_fast_paths_match_reference_in_simulator")):
        if nodeid.endswith("::" + test):
            return name
    return None


class _Jobs:
    def __init__(self):
        self._cond = threading.Condition()
        self._queue = []        # names not started yet, in order
        self._results = {}      # name -> (returncode, stdout, stderr, seed)
        self._started = set()
        self._thread = None
        self.running = None     # the job's subprocess while one runs

    def scheduled(self, name):
        """Whether job `name` was queued or started in this process."""
        with self._cond:
            return name in self._started or name in self._queue

    def start(self, names):
        """Queue `names` (longest first) for the background thread; start it if needed."""
        with self._cond:
            for name in sorted(names, key=lambda n: -_COST[n]):
                if name not in self._started and name not in self._queue:
                    self._queue.append(name)
            if self._queue and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="fp8blk-sim-jobs")
                self._thread.start()

    def _work(self):
        while True:
            with self._cond:
                if not self._queue:
                    return
                name = self._queue.pop(0)
                self._started.add(name)
            try:
                out = _run(name)
            except Exception as exc:  # e.g. the interpreter could not start: fail the tests
                out = (-1, "", f"could not run the job: {exc!r}", None)
            with self._cond:
                self._results[name] = out
                self._cond.notify_all()

    def result(self, name):
        """(returncode, stdout, stderr, seed) of job `name`, waiting for it (started here if
        it was not queued: moved to the front of the queue)."""
        with self._cond:
            if name not in self._started and name in self._queue:
                self._queue.remove(name)
                self._queue.insert(0, name)
        self.start([name])
        with self._cond:
            while name not in self._results:
                self._cond.wait()
            return self._results[name]


def _text(out):
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _run(name):
    seed = int.from_bytes(os.urandom(4), "little")
    path = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path)
    if name in _SIMULATED:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    command = [sys.executable, *_SCRIPTS[name], str(seed)]
    proc = subprocess.Popen(command, cwd=_REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    JOBS.running = proc
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
        return proc.returncode, out, err, seed
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -1, _text(out), f"timed out after {TIMEOUT} s\n{_text(err)}", seed
    finally:
        JOBS.running = None


def stop():
    """End a job still running and drop the queued ones (the session is over)."""
    with JOBS._cond:
        JOBS._queue.clear()
    proc = JOBS.running
    if proc is not None and proc.poll() is None:
        proc.kill()


JOBS = _Jobs()


def result(name):
    return JOBS.result(name)


def to_start(nodeids):
    """The jobs a session selecting `nodeids` starts in the background: every job a test
    needs, but the PTX job only for at least ``_ptx.MIN_FOR_JOB`` compile tests (fewer
    compile in their own process)."""
    names = [job_of(n) for n in nodeids]
    from tests.kernels._ptx import MIN_FOR_JOB

    out = {n for n in names if n}
    if names.count("ptx") < MIN_FOR_JOB:
        out.discard("ptx")
    return out
