"""Launching multi-rank test programs (mpiexec, torchrun, or torch ranks started directly)
from pytest with a hard timeout.

Each launch runs in its own session and process group; on timeout the whole group (the
launcher and every rank) is killed and the test fails, so a hang never stalls the suite.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
REPO = HERE.parent.parent


def mpiexec_command():
    """[mpiexec, flags...]: $FP8BLK_MPIEXEC, else the mpiexec beside this Python (pip's mpich
    in the venv), else the one on PATH; Open MPI gets --allow-run-as-root --oversubscribe."""
    explicit = os.environ.get("FP8BLK_MPIEXEC")
    candidates = [explicit, str(Path(sys.executable).parent / "mpiexec"), shutil.which("mpiexec")]
    path = next((c for c in candidates if c and Path(c).exists()), None)
    if path is None:
        pytest.skip("no mpiexec found (pip install mpich, or set FP8BLK_MPIEXEC)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    flags = ["--allow-run-as-root", "--oversubscribe"] if re.search(
        r"Open MPI|OpenRTE|open-mpi", version) else []
    return [path] + flags


def _env(env):
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else []))
    full_env.update(env or {})
    return full_env


def run(command, timeout, env=None):
    """(returncode, combined output, seconds). Kills the process group on timeout and fails."""
    full_env = _env(env)
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=REPO, env=full_env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s (hang?); "
                    f"output:\n{output[-6000:]}")
    return process.returncode, output, time.monotonic() - start


def mpi(n, script, *args, timeout=120, env=None, mpi4py_module=True):
    """Run ``script`` on n ranks; ``mpi4py_module=False`` starts it as plain ``python script``
    (an uncaught exception then does not abort the other ranks: what must not hang)."""
    pytest.importorskip("mpi4py")
    module = ["-m", "mpi4py"] if mpi4py_module else []
    command = mpiexec_command() + ["-n", str(n), sys.executable, *module,
                                   str(SCRIPTS / script), *args]
    return run(command, timeout, env)


def torchrun(n, script, *args, timeout=180, env=None):
    pytest.importorskip("torch.distributed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", str(SCRIPTS / script), *args]
    return run(command, timeout, dict({"OMP_NUM_THREADS": "1"}, **(env or {})))


def ranks(n, argv, timeout=180, env=None, grace=30):
    """Run ``python *argv`` (a script path and its arguments, or ``-m module ...``) on n local
    ranks with the variables torchrun gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1), without torchrun's own
    process, which imports torch before it starts the ranks: one interpreter less per launch
    on CI's two cores. As under torchrun, a rank that fails ends the job: the others get
    `grace` seconds, then are killed. Returns (returncode: 0, or a failing or killed rank's;
    the ranks' output, rank by rank; seconds); a job past `timeout` fails the test."""
    pytest.importorskip("torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = _env(dict({"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
                      "LOCAL_WORLD_SIZE": str(n)}, **(env or {})))
    start = time.monotonic()
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, *map(str, argv)], stdout=logs[r],
                              stderr=subprocess.STDOUT, text=True, cwd=REPO,
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              start_new_session=True) for r in range(n)]
    code, failed_at, hung = 0, None, False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode for p in procs):
            failed_at = now
        hung = now - start > timeout
        if hung or (failed_at is not None and now - failed_at > grace):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
        code = code or p.returncode
    output = ""
    for log in logs:
        log.seek(0)
        output += log.read()
        log.close()
    if hung:
        pytest.fail(f"{' '.join(map(str, argv))} on {n} ranks did not finish within "
                    f"{timeout} s (hang?); output:\n{output[-6000:]}")
    return code, output, time.monotonic() - start


def suite_passes(output):
    """Number of ranks that printed SUITE OK (lines of ranks may interleave)."""
    return len(re.findall(r"SUITE OK", output))
