"""Every fp8blk import path that README.md and docs/*.md name still resolves.

Collected from the pages' code blocks and inline code spans: ``import fp8blk...`` and
``from fp8blk... import a, b`` statements, and dotted names ``fp8blk.x.y`` (a module, or a
module followed by attributes; ``fb.x.y`` too on pages that ``import fp8blk as fb``). Each is imported, then its attributes looked up, so a module
moved or a name renamed without its docs fails here. Paths under ``fp8blk.torch`` skip only
where torch is not installed.
"""
import importlib
import importlib.util
import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./-])(fp8blk|fb)((?:\.[A-Za-z_]\w*)+)")
_IMPORT = re.compile(r"^\s*import\s+(fp8blk(?:\.\w+)*)(?:\s+as\s+\w+)?\s*$", re.M)
_FROM = re.compile(r"^\s*from\s+(fp8blk(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)


def _code(text):
    """The page's code: fenced blocks, then inline spans of the prose between them."""
    blocks = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    return blocks, _SPAN.findall(prose)


def paths():
    """Sorted [(page, dotted path)]: ``from m import a`` gives m.a; a bare module gives m."""
    found = set()
    for page in PAGES:
        text = page.read_text()
        alias = "import fp8blk as fb" in text
        blocks, spans = _code(text)
        for code in blocks + spans:
            for module in _IMPORT.findall(code):
                found.add((page.name, module))
            for module, names in _FROM.findall(code):
                for name in names.strip("()").replace("\n", " ").split(","):
                    name = name.split(" as ")[0].strip()
                    if name == "*":
                        found.add((page.name, module))
                    elif name.isidentifier():
                        found.add((page.name, f"{module}.{name}"))
            for head, rest in _DOTTED.findall(code):
                if head == "fp8blk" or alias:
                    found.add((page.name, "fp8blk" + rest))
    return sorted(found)


def resolve(dotted):
    """Import the longest importable module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(module_name)
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the name moved or was renamed
        return obj
    raise ModuleNotFoundError(dotted)


PATHS = paths()


def test_the_pages_name_paths():
    """The collector finds the paths (a broken regex would pass every case vacuously)."""
    names = {dotted for _, dotted in PATHS}
    assert {"fp8blk.quantize", "fp8blk.layout"} <= names
    assert any(name.startswith("fp8blk.torch") for name in names)
    assert len(names) > 20


@pytest.mark.parametrize("page, dotted", PATHS, ids=[f"{p}:{d}" for p, d in PATHS])
def test_path_resolves(page, dotted):
    if dotted == "fp8blk.torch" or dotted.startswith("fp8blk.torch."):
        pytest.importorskip("torch")
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{page} names {dotted}, which does not resolve: {type(exc).__name__}: {exc}")
