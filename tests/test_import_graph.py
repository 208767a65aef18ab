"""The package's module-level import graph has no cycle, and importing fp8blk imports
neither numba nor torch (numba only when a kernel is first needed; torch only if the program
uses it).

The graph is read from the sources (AST): an edge a -> b for every module-level ``import`` /
``from ... import`` in module a that names fp8blk module b (``from . import x`` names the
submodule x when it is one). Imports inside functions are lazy on purpose and not edges, nor are imports of a module's own
parent packages (Python imports those first in any case).
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import fp8blk

PKG = Path(fp8blk.__file__).resolve().parent


def _modules():
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module, is_package, level, name):
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(lazy=False):
    modules = _modules()
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ([tree] if lazy else tree.body):  # module level: incl. if/try blocks
            for sub in ast.walk(node) if lazy or isinstance(node, (ast.If, ast.Try)) else [node]:
                targets = []
                if isinstance(sub, ast.Import):
                    targets = [a.name for a in sub.names]
                elif isinstance(sub, ast.ImportFrom):
                    if sub.level:
                        base = _resolve(module, is_package, sub.level, sub.module)
                    else:
                        base = sub.module or ""
                    targets = [base]
                    targets += [f"{base}.{a.name}" for a in sub.names
                                if f"{base}.{a.name}" in modules]
                for t in targets:
                    # a parent package is always imported before its children: not an edge
                    if t in modules and t != module and not module.startswith(t + "."):
                        graph[module].add(t)
    return graph


def find_cycle(graph):
    state = {}
    stack = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert "fp8blk.layout" in graph and graph["fp8blk.tensor"], "graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cycle_even_through_lazy_imports():
    """Imports inside functions too: a lazy import that closes a loop (tensor -> _dispatch ->
    kernels -> ... -> tensor) still ties the modules together."""
    cycle = find_cycle(import_graph(lazy=True))
    assert cycle is None, "import cycle through lazy imports: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["fp8blk.layout"].add("fp8blk.tensor")  # tensor imports layout: a cycle
    assert find_cycle(graph) is not None


def test_import_fp8blk_loads_neither_numba_nor_torch():
    code = ("import sys, fp8blk; bad = [m for m in ('numba', 'torch', 'cupy') if m in "
            "sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ, PYTHONPATH=str(PKG.parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
