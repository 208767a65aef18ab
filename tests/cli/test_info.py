"""``python -m fp8blk info`` says why there is no GPU and what to install, with or without
torch and CuPy."""
import os
import subprocess
import sys
import types

import pytest

from fp8blk import cli

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_info_without_torch_and_cupy():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['cupy'] = None\n"
            "from fp8blk.cli import main; sys.exit(main(['info']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=_REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=_REPO))
    assert done.returncode == 0, done.stderr
    assert "torch      not available (ModuleNotFoundError)" in done.stdout
    assert ("GPU        no: CuPy is not installed (pip install 'fp8blk[gpu]'); fp8blk runs "
            "on the CPU") in done.stdout


def _fake_cupy(count=None, error=None, cc="90"):
    def device_count():
        if error is not None:
            raise error
        return count
    runtime = types.SimpleNamespace(getDeviceCount=device_count,
                                    getDeviceProperties=lambda i: {"name": b"Fake GPU"})
    device = types.SimpleNamespace(compute_capability=cc, id=0)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime,
                                                            Device=lambda: device))


class CUDARuntimeError(RuntimeError):
    pass


@pytest.mark.parametrize("fake, why", [
    (None, "CuPy is not installed (pip install 'fp8blk[gpu]')"),
    (_fake_cupy(error=CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                                       "insufficient")), "no usable CUDA driver"),
    (_fake_cupy(error=CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is "
                                       "detected")), "no CUDA device is visible"),
    (_fake_cupy(count=0), "no CUDA device is visible"),
    (_fake_cupy(count=1, cc="75"), "compute capability 7.5; the kernels need 8.9 or newer"),
])
def test_probe_says_why_there_is_no_gpu(monkeypatch, fake, why):
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cupy, reason, _ = cli.probe_gpu()
    assert cupy is None and why in reason


def test_probe_and_info_with_a_usable_gpu(monkeypatch, capsys):
    fake = _fake_cupy(count=1, cc="90")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert cli.probe_gpu() == (fake, "", (9, 0))
    assert cli.run_info(None) == 0
    assert "GPU        yes: Fake GPU, compute capability 9.0" in capsys.readouterr().out
