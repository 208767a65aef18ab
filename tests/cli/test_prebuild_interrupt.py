"""An interrupted ``prebuild`` (SIGINT, SIGTERM) stops its worker processes before it exits:
no compiler process outlives it. The workers here sleep instead of compiling (cheap)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs prebuild over two real variants with a worker job that sleeps; prints the worker pids
# once both are running, then waits to be killed.
_SCRIPT = r"""
import json, multiprocessing, sys, threading, time
from fp8blk.cli import prebuild as p
from fp8blk.kernels import _specs as sp

def slow(family, spec, cc, root):
    time.sleep(120)
    return True, 120.0

def report():
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.05)
    print("PIDS", json.dumps([c.pid for c in multiprocessing.active_children()]), flush=True)

threading.Thread(target=report, daemon=True).start()
variants = [("transpose", sp.TransposeSpec(True, True)),
            ("transpose", sp.TransposeSpec(False, True))]
args = type("Args", (), {"cc": (9, 0), "jobs": 2, "dir": sys.argv[1]})()
p.prebuild = lambda cc, jobs, root, _p=p.prebuild: _p(cc, jobs, root, variants, build=slow)
sys.exit(p.run(args))
"""


def _sigint_default():
    """In the child before exec: SIGINT to its default, so that Python installs its
    KeyboardInterrupt handler. A test runner started in the background by a shell without job
    control ignores SIGINT, and an ignored SIGINT is inherited across exec (the child would
    then never see the Ctrl-C this test sends)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid):
    """True while `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_killed_prebuild_leaves_no_worker(tmp_path, sig):
    env = dict(os.environ, PYTHONPATH=_REPO, FP8BLK_KERNEL_CACHE="1")
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=_REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("PIDS "):  # the progress bar's lines come first
            line = proc.stdout.readline()
        workers = json.loads(line[5:])
        assert len(workers) == 2 and all(_alive(w) for w in workers)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
        assert "prebuild interrupted: workers stopped" in proc.stderr.read()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)]
    finally:
        proc.kill()
        proc.wait()
