"""One-off profiles and probes, each with its last result in results/ (not rerun by run_gpu.sh unless its step says so). Run from the repository root: python -m bench.profile.<name>."""
