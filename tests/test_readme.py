"""The README's python blocks run as pasted: each alone, in a fresh interpreter.

A block whose first line is ``# mpiexec -n N...`` runs under ``mpiexec -n N python -m mpi4py``
(the venv's mpiexec, skipped where none is found), every other one under plain ``python``; each
with a timeout, so a hang fails instead of stalling the suite.
"""
import pathlib
import re
import sys

import pytest

from tests.comm.launch import mpiexec_command, run

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_RANKS = re.compile(r"#\s*mpiexec -n (\d+)")


def readme_blocks():
    """[(line, code)] of every ```python block of README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


BLOCKS = readme_blocks()


def test_readme_has_the_quickstart_blocks():
    codes = [code for _, code in BLOCKS]
    assert any("fb.quantize(" in c for c in codes)
    assert any("convert_to_float8_block" in c and ".backward()" in c for c in codes)
    assert any(_RANKS.match(c) for c in codes)


PARAMS = [pytest.param(line, code, id=f"README.md:{line}",
                       marks=[pytest.mark.mpi] if _RANKS.match(code) else [])
          for line, code in BLOCKS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line, code", PARAMS)
def test_readme_block(line, code, tmp_path):
    if "import torch" in code:
        pytest.importorskip("torch")
    script = tmp_path / f"readme_{line}.py"
    script.write_text(code + "\nprint('README BLOCK OK', flush=True)\n")
    ranks = _RANKS.match(code)
    if ranks:
        pytest.importorskip("mpi4py")
        n = int(ranks.group(1))
        command = mpiexec_command() + ["-n", str(n), sys.executable, "-m", "mpi4py", str(script)]
    else:
        n, command = 1, [sys.executable, str(script)]
    rc, output, _ = run(command, timeout=240)
    assert rc == 0 and output.count("README BLOCK OK") == n, \
        f"README.md block at line {line} failed ({' '.join(command)}):\n{output[-4000:]}"
