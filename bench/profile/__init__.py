"""One-off profiles and probes; each keeps its last result in results/<name>-<machine>.* or in
its docstring. Run from the repository root: python -m bench.profile.<name>."""
