"""PTX for the compile tests (test_quantize_compile, test_dequantize_compile, test_partial's
kernel tests), made in one background job of the session (tests/sim_jobs.py, job "ptx") on
CI's second core instead of one compile per test in the session's own process.

A test module registers each case at import -- ``case(key, make)``, ``make()`` giving
``(pyfunc, argtypes, launch_bounds)`` -- and its test asks for ``ptx(key)``. The job
(``python -m tests.kernels._ptx``) imports the modules, compiles every case and prints one
JSON line {key: ptx, or "ERROR ..." for a case that raised}. Where the session did not start
the job (a few compile tests selected, or a pytest-xdist worker), ``ptx`` compiles the case
in the test's own process.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback

MODULES = ("tests.kernels.test_quantize_compile", "tests.kernels.test_dequantize_compile",
           "tests.kernels.test_partial")
MIN_FOR_JOB = 10        # fewer selected compile tests compile in their own process
_CASES = {}             # key -> make
_TABLE = {}             # the job's output, parsed once: {"table": {key: ptx}}


def case(key, make):
    """Register the compile case `key`; ``make()`` -> (pyfunc, argtypes, launch_bounds)."""
    _CASES[key] = make
    return key


def compile_case(key):
    from fp8blk.kernels._numba import compile_ptx_sm90

    pyfunc, argtypes, bounds = _CASES[key]()
    return compile_ptx_sm90(pyfunc, argtypes, launch_bounds=bounds)


def ptx(key):
    """The PTX of case `key`: from the session's job where it runs, else compiled here."""
    from tests import sim_jobs

    if not sim_jobs.JOBS.scheduled("ptx"):
        return compile_case(key)
    if "table" not in _TABLE:
        code, out, err, _ = sim_jobs.result("ptx")
        assert code == 0, f"the PTX job failed:\n{out[-2000:]}\n{err[-6000:]}"
        _TABLE["table"] = json.loads(out.splitlines()[0])
    value = _TABLE["table"].get(key)
    assert value is not None, f"the PTX job made no PTX for {key}"
    assert not value.startswith("ERROR"), value
    return value


def main():
    # run as __main__: the test modules register their cases in the importable module
    from tests.kernels import _ptx as registry

    for name in MODULES:
        importlib.import_module(name)
    out = {}
    for key in list(registry._CASES):
        try:
            out[key] = registry.compile_case(key)
        except Exception:  # noqa: BLE001  (the case's test fails with it)
            out[key] = "ERROR " + traceback.format_exc()
    sys.stdout.write(json.dumps(out) + "\nOK ptx\n")


if __name__ == "__main__":
    main()
