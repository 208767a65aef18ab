"""The examples in docs/*.md run, so the docs cannot rot.

A ```python block preceded by ``<!-- runnable -->`` is executed alone, in a fresh namespace, as a
reader would paste it; a block whose first line is ``# continues the block above`` runs in the
namespace its file's previous runnable block left. All files run in ONE subprocess (mpi4py and
torch are imported at most once, and a crash cannot take pytest down). Blocks
marked ``<!-- runnable: gpu -->`` run the same way in a second subprocess where a GPU is
present (``-m gpu``), and are only compiled elsewhere; blocks marked ``<!-- runnable: mpi N -->``
run each under ``mpiexec -n N python -m mpi4py`` with a timeout (a few seconds each on 2
cores; skipped where no mpiexec is found). Every other ```python block must compile too.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"(?:<!--\s*runnable(?::\s*(?P<tag>[^>]*?))?\s*-->\s*\n)?```python\n"
                    r"(?P<code>.*?)```", re.S)


def blocks():
    """[(file name, line, tag, code)]: tag is None (not runnable), '' (run) or the marker."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()
        for match in _BLOCK.finditer(text):
            tag = match.group("tag")
            runnable = match.group(0).startswith("<!--")
            line = text.count("\n", 0, match.start("code")) + 1
            found.append((path.name, line, (tag or "").strip() if runnable else None,
                          match.group("code")))
    return found


CONTINUES = "# continues the block above"

_RUNNER = r"""
import json, sys, traceback
CONTINUES = %r
blocks = json.loads(sys.stdin.read())
results, space, previous = {}, {}, None
for name, line, code in blocks:
    if not (name == previous and code.startswith(CONTINUES)):
        space = {"__name__": "__docs__"}
    previous = name
    try:
        exec(compile(code, f"{name}:{line}", "exec"), space)
        results[f"{name}:{line}"] = None
    except BaseException:
        results[f"{name}:{line}"] = traceback.format_exc()
print("@@RESULTS@@" + json.dumps(results))
""" % CONTINUES


def _run(tag):
    """Run every block marked `tag` in one subprocess: {"file:line": None or traceback}."""
    to_run = [(name, line, code) for name, line, t, code in blocks() if t == tag]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(to_run), text=True,
                          capture_output=True, cwd=ROOT, env=env, timeout=240)
    marker = proc.stdout.rfind("@@RESULTS@@")
    assert marker >= 0, f"the docs runner died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout[marker + len("@@RESULTS@@"):])


def _run_mpi(name, line, code, ranks, request):
    from tests.comm.launch import mpi

    tmp = request.getfixturevalue("tmp_path")
    script = tmp / f"docs_{name.replace('.', '_')}_{line}.py"
    script.write_text(code + "\nprint('DOCS BLOCK OK', flush=True)\n")
    rc, output, _ = mpi(ranks, str(script), timeout=90)
    assert rc == 0 and output.count("DOCS BLOCK OK") == ranks, \
        f"docs/{name} block at line {line} failed under mpiexec -n {ranks}:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def run_results():
    return _run("")


@pytest.fixture(scope="module")
def gpu_results():
    return _run("gpu")


ALL = blocks()
PARAMS = [pytest.param(*b, id=f"{b[0]}:{b[1]}",
                       marks=[pytest.mark.gpu] if b[2] == "gpu" else
                       [pytest.mark.mpi] if (b[2] or "").startswith("mpi") else [])
          for b in ALL]


def test_docs_have_runnable_examples():
    names = {name for name, _, tag, _ in ALL if tag == ""}
    assert {"numerics.md", "layouts.md", "api.md", "distributed.md"} <= names, names


def test_compile_everywhere():
    """Every block is valid Python, GPU and MPI ones included (they are skipped below without
    a GPU / mpiexec)."""
    for name, line, tag, code in ALL:
        compile(code, f"{name}:{line}", "exec")
        assert tag in (None, "", "gpu") or re.fullmatch(r"mpi \d+", tag), \
            f"docs/{name}:{line}: unknown marker {tag!r}"


@pytest.mark.parametrize("name,line,tag,code", PARAMS)
def test_block(name, line, tag, code, request):
    if tag is None:
        pytest.skip("not marked runnable (compiled only)")
    if tag.startswith("mpi"):
        _run_mpi(name, line, code, int(tag.split()[1]), request)  # skips without mpiexec
        return
    fixture = "gpu_results" if tag == "gpu" else "run_results"
    error = request.getfixturevalue(fixture)[f"{name}:{line}"]
    assert error is None, f"docs/{name} block at line {line} failed:\n{error}"
