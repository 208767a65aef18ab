"""The examples in docs/*.md run, so the docs cannot rot.

A ```python block preceded by ``<!-- runnable -->`` is executed; the blocks of one file run in
order in one namespace (later examples may use earlier names), all files in ONE subprocess
(mpi4py and torch are imported at most once, and a crash cannot take pytest down). Blocks
marked ``<!-- runnable: gpu -->`` or ``<!-- runnable: mpi N -->`` (N > 1 ranks) are only
compiled here: they need a GPU or ``mpiexec``. Every other ```python block must at least
compile too.
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


_RUNNER = r"""
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
results, spaces = {}, {}
for name, line, code in blocks:
    space = spaces.setdefault(name, {"__name__": "__docs__"})
    try:
        exec(compile(code, f"{name}:{line}", "exec"), space)
        results[f"{name}:{line}"] = None
    except BaseException:
        results[f"{name}:{line}"] = traceback.format_exc()
print("@@RESULTS@@" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def run_results():
    to_run = [(name, line, code) for name, line, tag, code in blocks() if tag == ""]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(to_run), text=True,
                          capture_output=True, cwd=ROOT, env=env, timeout=240)
    marker = proc.stdout.rfind("@@RESULTS@@")
    assert marker >= 0, f"the docs runner died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout[marker + len("@@RESULTS@@"):])


ALL = blocks()


def test_docs_have_runnable_examples():
    names = {name for name, _, tag, _ in ALL if tag == ""}
    assert {"numerics.md", "layouts.md", "api.md", "distributed.md"} <= names, names


@pytest.mark.parametrize("name,line,tag,code", ALL, ids=[f"{n}:{line}" for n, line, _, _ in ALL])
def test_block(name, line, tag, code, request):
    compile(code, f"{name}:{line}", "exec")  # every block is valid Python
    if tag is None:
        return
    if tag != "":
        assert tag == "gpu" or re.fullmatch(r"mpi \d+", tag), f"unknown marker {tag!r}"
        pytest.skip(f"needs {'a GPU' if tag == 'gpu' else 'mpiexec -n ' + tag.split()[1]}")
    error = request.getfixturevalue("run_results")[f"{name}:{line}"]
    assert error is None, f"docs/{name} block at line {line} failed:\n{error}"
