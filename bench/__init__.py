"""GPU benchmarks of fp8blk (not installed). Run from the repository root: python -m bench.<name>."""
