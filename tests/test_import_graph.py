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


# -- layering: which room may import which ---------------------------------------------------
# A room is a root module (fp8blk.ops), a subpackage (fp8blk.kernels, fp8blk.master,
# fp8blk.torch, fp8blk.cli) or the comm transport (fp8blk.comm) beside its feature folders
# (fp8blk.comm.gather, fp8blk.comm.dispatch). A room may import the rooms listed for it, lazily
# or not, and nothing else: the floors of docs/index.md's map, bottom up.
_LOW = {"formats", "layout", "_arrays", "_bounded"}
ALLOWED = {
    "formats": set(), "layout": {"formats"}, "_arrays": set(), "_bounded": set(),
    "scaling": {"formats", "layout"},
    "reference": {"formats", "layout", "scaling", "_arrays"},
    "kernels": _LOW | {"scaling"},
    "_dispatch": {"_arrays", "reference", "kernels"},
    "tensor": _LOW | {"_dispatch"},
    "ops": _LOW | {"_dispatch", "reference", "kernels", "tensor"},
    "comm": _LOW,
    "comm.gather": _LOW | {"scaling", "reference", "_dispatch", "tensor", "ops", "comm"},
    "comm.dispatch": _LOW | {"tensor", "ops", "comm"},
    "master": _LOW | {"scaling", "reference", "_dispatch", "kernels", "tensor", "ops", "comm"},
    "torch": _LOW | {"scaling", "reference", "_dispatch", "kernels", "tensor", "ops", "comm",
                     "comm.gather", "master"},
}


def documented_layering():
    """{room: set of rooms it may import} as docs/index.md's house map states it."""
    text = (PKG.parent / "docs" / "index.md").read_text()
    table = text.split("## The house: rooms and floors", 1)[1].split("\n\n")[2]
    out = {}
    for row in table.splitlines()[2:]:
        floor, rooms, _, may = [c.strip() for c in row.strip("|").split("|")]
        if floor == "top":
            continue
        allowed = set()
        for item in may.split(", "):
            if item == "floor 0":
                allowed |= _LOW
            elif item != "nothing of fp8blk":
                allowed.add(item.strip("`"))
        for room in rooms.split(", "):
            out[room.strip("`")] = allowed
    return out


def test_docs_house_map_is_the_layering_rule():
    assert documented_layering() == ALLOWED


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "fp8blk"
    if parts[1] == "comm" and len(parts) > 2 and parts[2] in ("gather", "dispatch"):
        return "comm." + parts[2]
    if parts[1] == "__main__":
        return "cli"
    return parts[1]


def _is_face_of(module, target):
    """A package's __init__ re-exporting its own subpackage (fp8blk.comm -> comm.gather)."""
    return target.startswith(module + ".")


def layering_violations(graph):
    modules = _modules()
    bad = []
    for a, targets in graph.items():
        ra = room_of(a)
        if ra in ("fp8blk", "cli"):  # the package face and the command line sit on top
            continue
        for b in targets:
            rb = room_of(b)
            if rb == ra or rb in ALLOWED.get(ra, set()):
                continue
            if modules[a].name == "__init__.py" and _is_face_of(a, b):
                continue
            bad.append(f"{a} ({ra}) imports {b} ({rb})")
    return sorted(bad)


def test_rooms_import_only_the_rooms_below():
    graph = import_graph(lazy=True)
    unknown = sorted({room_of(m) for m in graph} - set(ALLOWED) - {"fp8blk", "cli"})
    assert not unknown, f"rooms without a layering rule: {unknown} (add them to ALLOWED)"
    bad = layering_violations(graph)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_layering_check_finds_a_planted_upward_import():
    graph = import_graph(lazy=True)
    graph["fp8blk.kernels.quantize"].add("fp8blk.tensor")
    assert layering_violations(graph)


# -- private names: a private module _x of package P is for P's modules; a private name _y of
# module M (a function, class or attribute reached through M or a name imported from M) is for
# M alone. Checked in fp8blk and in bench/'s benchmarks, which use what users and rooms can
# use; the probes under bench/profile/ measure internals on purpose and are not checked.
def _owner_allows(importer: str, target: str) -> bool:
    parts = target.split(".")
    for i, seg in enumerate(parts):
        if seg.startswith("_") and not seg.startswith("__"):
            owner = ".".join(parts[:i])
            if not (importer == owner or importer.startswith(owner + ".")):
                return False
    return True


def private_reads(path: Path, module: str, is_package: bool):
    """(target, line) for every private fp8blk name `module` reads that is not its own."""
    tree = ast.parse(path.read_text(), filename=str(path))
    alias, out = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (_resolve(module, is_package, node.level, node.module) if node.level
                    else node.module or "")
            if not base.startswith("fp8blk"):
                continue
            for a in node.names:
                target = f"{base}.{a.name}"
                if not _owner_allows(module, target):
                    out.append((target, node.lineno))
                alias[a.asname or a.name] = target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fp8blk"):
                    if not _owner_allows(module, a.name):
                        out.append((a.name, node.lineno))
                    alias[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0])
    for node in ast.walk(tree):  # module.attr chains: fp8blk.kernels._specs, kq._plan
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            chain, v = [node.attr], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in alias:
                target = ".".join([alias[v.id]] + chain[::-1])
                if not _owner_allows(module, target):
                    out.append((target, node.lineno))
    return out


def _bench_files():
    root = PKG.parent / "bench"
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.py") if "profile" not in p.relative_to(root).parts)


def all_private_reads():
    bad = []
    for module, path in sorted(_modules().items()):
        for target, line in private_reads(path, module, path.name == "__init__.py"):
            bad.append(f"{path.relative_to(PKG.parent)}:{line} reads {target}")
    for path in _bench_files():
        for target, line in private_reads(path, "bench", False):
            bad.append(f"{path.relative_to(PKG.parent)}:{line} reads {target}")
    return bad


def test_no_room_reads_another_rooms_private_names():
    bad = all_private_reads()
    assert not bad, "private names read across rooms:\n" + "\n".join(bad)


def test_private_name_check_finds_planted_reads(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from fp8blk.kernels import _specs\nfrom fp8blk import tensor\n"
                       "tensor._check_shape((1,))\nimport fp8blk.kernels._cache as c\n")
    found = {t for t, _ in private_reads(planted, "fp8blk.torch.planted", False)}
    assert found == {"fp8blk.kernels._specs", "fp8blk.tensor._check_shape",
                     "fp8blk.kernels._cache"}, found
    own = tmp_path / "own.py"
    own.write_text("from . import _specs\nfrom ._specs import BLOCK\n")
    assert private_reads(own, "fp8blk.kernels.quantize", False) == []


# -- private attributes: ``obj._x`` where ``_x`` is a private attribute that fp8blk defines
# (assigned as ``something._x = ...``, a class-body name, a method, or a ``__slots__`` entry)
# is for the module that defines it; another module reading it goes around that module's doors.
# Names fp8blk never defines (torch's ``_local_tensor``, ``torch._C``) are other libraries',
# as are those in OTHER_LIBRARIES, which fp8blk also happens to define.
OTHER_LIBRARIES = {"_base"}  # torch.Tensor._base: the tensor a view was made from


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def private_attributes_defined(tree):
    """The private attribute names a module's source defines."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and _is_private(node.attr):
            out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and _is_private(item.name):
                    out.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Name) and _is_private(t.id):
                        out.add(t.id)
                    if isinstance(t, ast.Name) and t.id == "__slots__":
                        for elt in ast.walk(item.value):
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str) \
                                    and _is_private(elt.value):
                                out.add(elt.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value):
            out.add(node.args[1].value)
    return out


def private_attribute_reads(sources):
    """``sources``: {module: source text}. Every ``x._a`` (read or written) in a module that
    does not define ``_a`` itself, where another module does: "module:line reads _a (defined
    in ...)"."""
    trees = {m: ast.parse(text) for m, text in sources.items()}
    defined = {m: private_attributes_defined(t) for m, t in trees.items()}
    owners = {}
    for m, names in defined.items():
        for name in names:
            owners.setdefault(name, set()).add(m)
    bad = []
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) \
                    and node.attr in owners and node.attr not in defined[m] \
                    and node.attr not in OTHER_LIBRARIES:
                where = ", ".join(sorted(owners[node.attr]))
                bad.append(f"{m}:{node.lineno} reads {node.attr} (defined in {where})")
    return sorted(bad)


def test_no_module_reads_another_modules_private_attributes():
    sources = {m: p.read_text() for m, p in _modules().items()}
    bad = private_attribute_reads(sources)
    assert not bad, "private attributes read across modules:\n" + "\n".join(bad)


def test_private_attribute_check_finds_planted_reads():
    owner = ("class W:\n    __slots__ = ('_state',)\n    def _peek(self):\n        pass\n"
             "def make(w):\n    w._cache = 1\n")
    reader = "def f(w):\n    return w._state, w._peek(), w._cache, w._other, w.__dict__\n"
    bad = private_attribute_reads({"fp8blk.a": owner, "fp8blk.b": reader})
    assert sorted(b.split(" reads ")[1].split()[0] for b in bad) == ["_cache", "_peek", "_state"]
    assert private_attribute_reads({"fp8blk.a": owner + reader}) == []
